//! What the Kubernetes placer writes: the settings of the cluster file's `[kube]` table, and
//! from them the objects of a job (names and labels, the servers' pods and services, a
//! worker's pod, the certificates' secret and the job file's config map).

use super::*;

/// Where and how the placer runs pods.
#[derive(Clone, Debug)]
pub struct KubeSettings {
    /// The namespace of every object.
    pub namespace: String,
    /// The container image, with `edl-ps` and `edl-worker` on its `PATH` (a job's `[worker]
    /// image` replaces it for its workers).
    pub image: String,
    /// Whether each worker asks for one GPU (`nvidia.com/gpu: 1`) unless its job file's
    /// `[worker] gpus` says otherwise.
    pub gpus: bool,
    /// Where workers read their data inside their containers (the cluster file's `data_dir`).
    pub data_dir: PathBuf,
    /// A PersistentVolumeClaim mounted read-only at `data_dir` in workers; without one the
    /// image must hold the data. Data paths in job files must exist in the workers too.
    pub data_claim: Option<String>,
    /// Extra arguments for every worker.
    pub worker_args: Vec<String>,
}

/// `s` as a DNS-1035 label of at most 40 characters (lowercase letters, digits and `-`,
/// starting with a letter, ending with a letter or digit). A name that is not one already is
/// lowercased, gets `-` for other characters, `x` in front unless it starts with a letter, and
/// a hash of the original as a suffix, so that `a_b` and `a-b` stay apart.
pub fn dns_label(s: &str) -> String {
    let valid = s.len() <= MAX_LABEL
        && s.starts_with(|c: char| c.is_ascii_lowercase())
        && s.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if valid {
        return s.to_string();
    }
    let mut base: String = s
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .collect();
    if !base.starts_with(|c: char| c.is_ascii_lowercase()) {
        base.insert(0, 'x');
    }
    // The suffix is `-` and 8 hex digits.
    base.truncate(MAX_LABEL - 9);
    // FNV-1a: stable across builds and platforms.
    let hash = s.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    format!("{base}-{hash:08x}")
}

/// The name of the pod (and, for servers, the Service) of process `name` of `job`.
pub fn pod_name(job: &str, name: &str) -> String {
    format!("{}-{}", dns_label(job), dns_label(name))
}

/// The name of the Secret holding the certificates of pod `pod`.
pub fn secret_name(pod: &str) -> String {
    format!("{pod}-pki")
}

/// The name of the ConfigMap holding `job`'s job file.
pub fn config_map_name(job: &str) -> String {
    format!("{}-job", dns_label(job))
}

/// The label selector of every object of `job`.
pub fn job_selector(job: &str) -> String {
    format!("{}={},{JOB_LABEL}={}", APP.0, APP.1, dns_label(job))
}

pub(super) fn labels(job: &str, name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (APP.0.to_string(), APP.1.to_string()),
        (JOB_LABEL.to_string(), dns_label(job)),
        (NAME_LABEL.to_string(), name.to_string()),
    ])
}

pub(super) fn meta(ns: &str, name: String, labels: BTreeMap<String, String>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(ns.to_string()),
        labels: Some(labels),
        ..ObjectMeta::default()
    }
}

/// Sets `flag`'s value in `args` (the first occurrence), or appends the flag and value.
pub(super) fn set_flag(args: &mut Vec<OsString>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = value.into(),
        _ => args.extend([flag.into(), value.into()]),
    }
}

pub(super) fn strings(args: Vec<OsString>) -> Vec<String> {
    args.into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// The credentials of a pod, as mounted from its Secret.
pub(super) fn mounted_creds() -> Creds {
    let dir = Path::new(PKI_DIR);
    Creds {
        ca: dir.join("ca.pem"),
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
    }
}

/// Stands for the coordinator's address in the launcher's argument lists until `--coordinator`
/// is set to the coordinator Service's DNS name.
pub(super) const UNSET: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), COORDINATOR_PORT);

impl KubeSettings {
    /// The DNS name and port of `job`'s Service for process `name`.
    pub fn service_addr(&self, job: &str, name: &str, port: u16) -> String {
        format!("{}.{}.svc:{port}", pod_name(job, name), self.namespace)
    }

    /// The Secret of process `name` of `job`: the CA certificate and the process's certificate
    /// and key (PEM), as `ca.pem`, `cert.pem` and `key.pem`.
    pub fn pki_secret(&self, job: &str, name: &str, ca: &[u8], cert: &[u8], key: &[u8]) -> Secret {
        let data = [("ca.pem", ca), ("cert.pem", cert), ("key.pem", key)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
            .collect();
        Secret {
            metadata: meta(
                &self.namespace,
                secret_name(&pod_name(job, name)),
                labels(job, name),
            ),
            type_: Some("Opaque".into()),
            data: Some(data),
            ..Secret::default()
        }
    }

    /// The ConfigMap holding `job`'s job file as `job.toml`.
    pub fn job_config_map(&self, job: &str, job_toml: &str) -> ConfigMap {
        ConfigMap {
            metadata: meta(&self.namespace, config_map_name(job), labels(job, "job")),
            data: Some(BTreeMap::from([("job.toml".into(), job_toml.into())])),
            ..ConfigMap::default()
        }
    }

    /// The Service of server `name` of `job` (the coordinator, or a shard `s<i>`): a ClusterIP
    /// in front of its pod's UDP `port`.
    pub fn server_service(&self, job: &str, name: &str, port: u16) -> Service {
        let mut selector = labels(job, name);
        selector.insert(ROLE_LABEL.into(), server_role(name).to_string());
        Service {
            metadata: meta(&self.namespace, pod_name(job, name), labels(job, name)),
            spec: Some(ServiceSpec {
                type_: Some("ClusterIP".into()),
                selector: Some(selector),
                ports: Some(vec![ServicePort {
                    name: Some("quic".into()),
                    protocol: Some("UDP".into()),
                    port: i32::from(port),
                    target_port: Some(IntOrString::Int(i32::from(port))),
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        }
    }

    /// The coordinator's pod of `job` with `shards` shard servers.
    pub fn coordinator_pod(&self, job: &str, shards: u32) -> Pod {
        let state = Path::new(STATE_DIR);
        let mut args = launch::coordinator_args(
            state,
            &state.join("coordinator.addr"),
            shards,
            // As with the local placer: stragglers are flagged, never acted on.
            &StragglerSettings::default(),
            Some(&mounted_creds()),
        );
        set_flag(
            &mut args,
            "--listen",
            &format!("0.0.0.0:{COORDINATOR_PORT}"),
        );
        set_flag(&mut args, "--job", &format!("{JOB_DIR}/job.toml"));
        let mut pod = self.pod(
            job,
            "coordinator",
            Role::Coordinator,
            PS_PROGRAM,
            strings(args),
            Some(COORDINATOR_PORT),
        );
        add_volume(
            &mut pod,
            Volume {
                name: "job".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: config_map_name(job),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            },
            JOB_DIR,
        );
        pod
    }

    /// The pod of shard server `shard` (`s<i>`) of `job`, advertising its Service's DNS name.
    pub fn shard_pod(&self, job: &str, shard: &str) -> Pod {
        let state = Path::new(STATE_DIR);
        let mut args = launch::shard_args(
            &UNSET,
            shard,
            &format!("0.0.0.0:{SHARD_PORT}"),
            state,
            &state.join(format!("{shard}.addr")),
            Some(&mounted_creds()),
        );
        let coordinator = self.service_addr(job, "coordinator", COORDINATOR_PORT);
        set_flag(&mut args, "--coordinator", &coordinator);
        set_flag(
            &mut args,
            "--advertise",
            &self.service_addr(job, shard, SHARD_PORT),
        );
        self.pod(
            job,
            shard,
            Role::Shard,
            PS_PROGRAM,
            strings(args),
            Some(SHARD_PORT),
        )
    }

    /// The pod of worker `worker` of `job` in `slot` for placement `placement`, running what
    /// `spec` says: on the slot's host unless it is `localhost`, with the devices it asks for.
    pub fn worker_pod(
        &self,
        job: &str,
        worker: &str,
        spec: &WorkerSpec,
        slot: &Slot,
        placement: Option<u64>,
    ) -> Pod {
        // What a local placer would start, as a container: edl-worker or the job's command
        // (in the image's working directory), with the contract's environment.
        let worker_args: Vec<OsString> = self.worker_args.iter().map(Into::into).collect();
        let launch = WorkerLaunch {
            spec,
            workdir: Path::new(""),
            env: WorkerEnv {
                coordinators: vec![self.service_addr(job, "coordinator", COORDINATOR_PORT)],
                credentials: mounted_creds().contract(),
                job: job.to_string(),
                name: worker.to_string(),
                placement,
                // The device plugin picks the devices and sets what the container sees.
                devices: None,
            },
            data_dir: &self.data_dir,
            state_dir: Path::new(STATE_DIR),
            worker_args: &worker_args,
        };
        let bins = Binaries {
            ps: PS_PROGRAM.into(),
            worker: WORKER_PROGRAM.into(),
        };
        let spawn = launch::worker_spawn(&bins, &launch, worker.to_string(), PathBuf::new());
        let program = spawn.program.to_string_lossy().into_owned();
        let mut env: Vec<EnvVar> = spawn
            .env
            .into_iter()
            .map(|(name, value)| EnvVar {
                name,
                value: Some(value.to_string_lossy().into_owned()),
                ..EnvVar::default()
            })
            .collect();
        env.sort_by(|a, b| a.name.cmp(&b.name));
        let mut pod = self.pod(
            job,
            worker,
            Role::Worker,
            &program,
            strings(spawn.args),
            None,
        );
        pod.metadata
            .labels
            .get_or_insert_default()
            .insert(SLOT_LABEL.into(), dns_label(&slot.name));
        let gpus = spec.gpus.unwrap_or(u32::from(self.gpus));
        let image = spec.image.clone();
        let Some(pod_spec) = pod.spec.as_mut() else {
            return pod;
        };
        pod_spec.termination_grace_period_seconds = Some(WORKER_GRACE.as_secs() as i64);
        if slot.host != LOCAL_HOST {
            pod_spec.node_selector = Some(BTreeMap::from([(
                "kubernetes.io/hostname".into(),
                slot.host.clone(),
            )]));
        }
        if let Some(c) = pod_spec.containers.first_mut() {
            c.env = Some(env);
            if let Some(image) = image {
                c.image = Some(image);
            }
            if gpus > 0 {
                c.resources = Some(ResourceRequirements {
                    limits: Some(BTreeMap::from([(
                        "nvidia.com/gpu".into(),
                        Quantity(gpus.to_string()),
                    )])),
                    ..ResourceRequirements::default()
                });
            }
        }
        if let Some(claim) = &self.data_claim {
            add_volume(
                &mut pod,
                Volume {
                    name: "data".into(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim.clone(),
                        read_only: Some(true),
                    }),
                    ..Volume::default()
                },
                &self.data_dir.to_string_lossy(),
            );
        }
        pod
    }

    /// A pod running `program` with `args`, its Secret mounted at [`PKI_DIR`] and an
    /// `emptyDir` at [`STATE_DIR`]; it never restarts.
    pub(super) fn pod(
        &self,
        job: &str,
        name: &str,
        role: Role,
        program: &str,
        args: Vec<String>,
        port: Option<u16>,
    ) -> Pod {
        let pod = pod_name(job, name);
        let mut labels = labels(job, name);
        labels.insert(ROLE_LABEL.into(), role.to_string());
        Pod {
            metadata: meta(&self.namespace, pod.clone(), labels),
            spec: Some(PodSpec {
                restart_policy: Some("Never".into()),
                // EDL's processes never call the Kubernetes API.
                automount_service_account_token: Some(false),
                containers: vec![Container {
                    name: role.to_string(),
                    image: Some(self.image.clone()),
                    command: Some(vec![program.into()]),
                    args: Some(args),
                    ports: port.map(|p| {
                        vec![ContainerPort {
                            name: Some("quic".into()),
                            container_port: i32::from(p),
                            protocol: Some("UDP".into()),
                            ..ContainerPort::default()
                        }]
                    }),
                    volume_mounts: Some(vec![
                        VolumeMount {
                            name: "pki".into(),
                            mount_path: PKI_DIR.into(),
                            read_only: Some(true),
                            ..VolumeMount::default()
                        },
                        VolumeMount {
                            name: "state".into(),
                            mount_path: STATE_DIR.into(),
                            ..VolumeMount::default()
                        },
                    ]),
                    ..Container::default()
                }],
                volumes: Some(vec![
                    Volume {
                        name: "pki".into(),
                        secret: Some(SecretVolumeSource {
                            secret_name: Some(secret_name(&pod)),
                            ..SecretVolumeSource::default()
                        }),
                        ..Volume::default()
                    },
                    Volume {
                        name: "state".into(),
                        empty_dir: Some(EmptyDirVolumeSource::default()),
                        ..Volume::default()
                    },
                ]),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }
}

pub(super) fn server_role(name: &str) -> Role {
    if name == "coordinator" {
        Role::Coordinator
    } else {
        Role::Shard
    }
}

/// Adds `volume` to `pod`, mounted read-only at `path` in its container.
pub(super) fn add_volume(pod: &mut Pod, volume: Volume, path: &str) {
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    if let Some(c) = spec.containers.first_mut() {
        c.volume_mounts.get_or_insert_default().push(VolumeMount {
            name: volume.name.clone(),
            mount_path: path.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }
    spec.volumes.get_or_insert_default().push(volume);
}
