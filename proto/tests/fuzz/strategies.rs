//! Proptest strategies for the values that cross the wire: ids, job configurations, shard maps
//! and every `Request` and `Response` variant.
//!
//! Floats in headers are drawn without NaN so that decoded values can be compared with `==`;
//! the mutation properties in `frames.rs` reach NaN bit patterns anyway.

use edl_proto::job::{RangeOwner, ShardInfo};
use edl_proto::msg::{
    ChunkRef, DataSpan, EpochLedger, EpochStats, EvalRecord, EventKind, EventRecord, HistoryPoint,
    JobHistory, JobStatus, JobTrace, Judgement, KeyLoad, KeyRange, MoveReport, Partition,
    ShardEntry, ShardRole, ShardStats, StepRecord, WorkerInfo, WorkerState, WorkerStatus,
};
use edl_proto::place::{
    Placement, PlacementKind, PlacementState, ReplaceReason, Resize, StragglerPolicy,
    StragglerSettings,
};
use edl_proto::{
    Anneal, Clock, Consistency, Curve, Init, JobConfig, Key, LrSchedule, MapEpoch, ModelSection,
    OptimizerGroup, OptimizerSpec, Request, Response, ScheduleUnit, ShardId, ShardMap, TensorSpec,
    Token, WorkerId, WorkerScaling,
};
use proptest::collection::vec;
use proptest::prelude::*;

/// Short strings of any characters, including multi-byte ones.
pub fn text() -> BoxedStrategy<String> {
    prop_oneof![Just(String::new()), ".{1,12}", "[a-z0-9:./]{1,24}"].boxed()
}

/// Any f32 but NaN (infinities, subnormals and both zeros included).
pub fn f32_no_nan() -> BoxedStrategy<f32> {
    use proptest::num::f32;
    (f32::POSITIVE | f32::NEGATIVE | f32::NORMAL | f32::SUBNORMAL | f32::ZERO | f32::INFINITE)
        .boxed()
}

/// Any f64 but NaN.
pub fn f64_no_nan() -> BoxedStrategy<f64> {
    use proptest::num::f64;
    (f64::POSITIVE | f64::NEGATIVE | f64::NORMAL | f64::SUBNORMAL | f64::ZERO | f64::INFINITE)
        .boxed()
}

/// A u64 that is often at an edge (0, 1, the maximum) and otherwise anywhere.
pub fn edgy_u64() -> BoxedStrategy<u64> {
    prop_oneof![
        3 => any::<u64>(),
        1 => Just(0u64),
        1 => Just(u64::MAX),
        1 => 0u64..64,
    ]
    .boxed()
}

pub fn worker_id() -> BoxedStrategy<WorkerId> {
    edgy_u64().prop_map(WorkerId).boxed()
}

pub fn shard_id() -> BoxedStrategy<ShardId> {
    any::<u32>().prop_map(ShardId).boxed()
}

pub fn clock() -> BoxedStrategy<Clock> {
    edgy_u64().prop_map(Clock).boxed()
}

pub fn map_epoch() -> BoxedStrategy<MapEpoch> {
    edgy_u64().prop_map(MapEpoch).boxed()
}

pub fn token() -> BoxedStrategy<Token> {
    any::<[u8; 32]>().prop_map(Token).boxed()
}

pub fn chunk_ref() -> BoxedStrategy<ChunkRef> {
    (edgy_u64(), any::<u32>(), wire(), any::<bool>())
        .prop_map(|(key, len, wire, sparse)| ChunkRef::new(Key(key), len).coded(wire, sparse))
        .boxed()
}

pub fn chunks() -> BoxedStrategy<Vec<ChunkRef>> {
    vec(chunk_ref(), 0..12).boxed()
}

pub fn key_range() -> BoxedStrategy<KeyRange> {
    (edgy_u64(), edgy_u64())
        .prop_map(|(start, end)| KeyRange { start, end })
        .boxed()
}

pub fn data_span() -> BoxedStrategy<DataSpan> {
    any::<(u32, u32, u32, u32)>()
        .prop_map(|(epoch, partition, start, end)| DataSpan {
            epoch,
            partition,
            start,
            end,
        })
        .boxed()
}

pub fn partition() -> BoxedStrategy<Partition> {
    any::<(u32, u32, u32, u32)>()
        .prop_map(|(epoch, index, start, len)| Partition {
            epoch,
            index,
            start,
            len,
        })
        .boxed()
}

pub fn shard_info() -> BoxedStrategy<ShardInfo> {
    (shard_id(), text())
        .prop_map(|(id, addr)| ShardInfo { id, addr })
        .boxed()
}

/// A shard map as it may arrive from a peer: not necessarily sorted, gap-free or consistent.
pub fn any_shard_map() -> BoxedStrategy<ShardMap> {
    let range = (edgy_u64(), edgy_u64(), shard_id()).prop_map(|(start, end, shard)| RangeOwner {
        start,
        end,
        shard,
    });
    (
        map_epoch(),
        vec(shard_info(), 0..4),
        vec(range.clone(), 0..6),
        vec(range, 0..3),
    )
        .prop_map(|(epoch, shards, ranges, backups)| ShardMap {
            epoch,
            shards,
            ranges,
            backups,
        })
        .boxed()
}

pub fn tensor_spec() -> BoxedStrategy<TensorSpec> {
    let init = prop_oneof![
        Just(Init::Zeros),
        f32_no_nan().prop_map(|limit| Init::Uniform { limit }),
    ];
    (text(), vec(any::<u32>(), 0..4), init)
        .prop_map(|(name, shape, init)| TensorSpec { name, shape, init })
        .boxed()
}

pub fn optimizer() -> BoxedStrategy<OptimizerSpec> {
    (0..5usize, [any::<f64>(); 6], [any::<bool>(); 2])
        .prop_map(|(kind, x, b)| match kind {
            0 => OptimizerSpec::Sgd {
                lr: x[0],
                momentum: x[1],
                dampening: x[2],
                nesterov: b[0],
                weight_decay: x[3],
            },
            1 => OptimizerSpec::Adam {
                lr: x[0],
                beta1: x[1],
                beta2: x[2],
                eps: x[3],
                weight_decay: x[4],
                amsgrad: b[0],
                decoupled: b[1],
            },
            2 => OptimizerSpec::Adagrad {
                lr: x[0],
                lr_decay: x[1],
                weight_decay: x[2],
                initial_accumulator_value: x[3],
                eps: x[4],
            },
            3 => OptimizerSpec::RmsProp {
                lr: x[0],
                alpha: x[1],
                eps: x[2],
                weight_decay: x[3],
                momentum: x[5],
                centered: b[0],
            },
            _ => OptimizerSpec::Adadelta {
                lr: x[0],
                rho: x[1],
                eps: x[2],
                weight_decay: x[3],
            },
        })
        .boxed()
}

/// Any schedule: every curve with arbitrary settings, unit and scaling.
pub fn schedule() -> BoxedStrategy<LrSchedule> {
    (
        0..7usize,
        [any::<f64>(); 5],
        [edgy_u64(), edgy_u64()],
        vec(any::<u64>(), 0..4),
        [any::<bool>(); 4],
    )
        .prop_map(|(kind, x, n, milestones, b)| LrSchedule {
            curve: match kind {
                0 => Curve::Constant,
                1 => Curve::Step {
                    step_size: n[0],
                    gamma: x[0],
                },
                2 => Curve::MultiStep {
                    milestones,
                    gamma: x[0],
                },
                3 => Curve::Exponential { gamma: x[0] },
                4 => Curve::Cosine {
                    t_max: n[0],
                    eta_min: x[0],
                },
                5 => Curve::Linear {
                    start_factor: x[0],
                    end_factor: x[1],
                    total_iters: n[1],
                },
                _ => Curve::OneCycle {
                    total_steps: n[0],
                    pct_start: x[0],
                    anneal: if b[0] { Anneal::Cos } else { Anneal::Linear },
                    div_factor: x[1],
                    final_div_factor: x[2],
                    three_phase: b[1],
                    cycle_momentum: b[2],
                    base_momentum: x[3],
                    max_momentum: x[4],
                },
            },
            by: if b[3] {
                ScheduleUnit::Epoch
            } else {
                ScheduleUnit::Step
            },
            scale: [
                WorkerScaling::None,
                WorkerScaling::Linear,
                WorkerScaling::Sqrt,
            ][kind % 3],
        })
        .boxed()
}

pub fn consistency() -> BoxedStrategy<Consistency> {
    prop_oneof![
        Just(Consistency::Asp),
        Just(Consistency::Bsp),
        any::<u32>().prop_map(|staleness| Consistency::Ssp { staleness }),
    ]
    .boxed()
}

pub fn job_config() -> BoxedStrategy<JobConfig> {
    let model = prop_oneof![
        Just(ModelSection::custom()),
        (".{0,12}", ".{0,40}").prop_map(|(kind, settings)| ModelSection { kind, settings }),
    ];
    (
        model,
        vec(tensor_spec(), 0..4),
        any::<u32>(),
        (
            optimizer(),
            vec((vec(any::<u32>(), 0..3), optimizer()), 0..3),
            schedule(),
            vec((any::<u32>(), wire()), 0..3),
        ),
        consistency(),
        any::<(u32, u32, u32, u32)>(),
        edgy_u64(),
        any::<u32>(),
    )
        .prop_map(
            |(
                model,
                tensors,
                chunk_size,
                (optimizer, groups, schedule, wires),
                consistency,
                (batch_size, epochs, partition_size, train_samples),
                seed,
                lease_ms,
            )| JobConfig {
                model,
                tensors,
                chunk_size,
                optimizer,
                optimizer_groups: groups
                    .into_iter()
                    .map(|(tensors, optimizer)| OptimizerGroup { tensors, optimizer })
                    .collect(),
                schedule,
                consistency,
                batch_size,
                epochs,
                partition_size,
                train_samples,
                seed,
                lease_ms,
                replicas: 1,
                wire: Default::default(),
                tensor_wires: wires
                    .into_iter()
                    .map(|(tensor, w)| edl_proto::TensorWire {
                        tensor,
                        wire: w.into(),
                    })
                    .collect(),
                data: None,
            },
        )
        .boxed()
}

pub fn move_report() -> BoxedStrategy<MoveReport> {
    (
        edgy_u64(),
        edgy_u64(),
        edgy_u64(),
        shard_id(),
        shard_id(),
        map_epoch(),
        edgy_u64(),
        f64_no_nan(),
        f64_no_nan(),
    )
        .prop_map(
            |(t_ms, start, end, from, to, epoch, bytes, millis, hold_ms)| MoveReport {
                t_ms,
                start,
                end,
                from,
                to,
                epoch,
                bytes,
                millis,
                hold_ms,
            },
        )
        .boxed()
}

fn worker_state() -> BoxedStrategy<WorkerState> {
    prop_oneof![
        Just(WorkerState::Active),
        Just(WorkerState::Left),
        Just(WorkerState::Dead),
    ]
    .boxed()
}

fn event_record() -> BoxedStrategy<EventRecord> {
    let kind = prop_oneof![
        Just(EventKind::Join),
        Just(EventKind::Drain),
        Just(EventKind::Leave),
        Just(EventKind::Dead),
        Just(EventKind::Straggler),
        Just(EventKind::Recovered),
        Just(EventKind::Preempt),
        Just(EventKind::ReplaceRequested),
        Just(EventKind::Stalled),
    ];
    (edgy_u64(), edgy_u64(), kind, worker_id(), text(), text())
        .prop_map(
            |(t_ms, requested_ms, kind, worker, name, detail)| EventRecord {
                t_ms,
                requested_ms,
                kind,
                worker,
                name,
                detail,
            },
        )
        .boxed()
}

fn job_trace() -> BoxedStrategy<JobTrace> {
    let step = (edgy_u64(), worker_id(), clock()).prop_map(|(t_ms, worker, clock)| StepRecord {
        t_ms,
        worker,
        clock,
    });
    (
        vec(event_record(), 0..4),
        vec(step, 0..6),
        vec(move_report(), 0..3),
        edgy_u64(),
        edgy_u64(),
        any::<bool>(),
        any::<(u64, u64, u64)>(),
    )
        .prop_map(
            |(events, steps, moves, first_step, next_step, more, dropped)| JobTrace {
                events,
                steps,
                moves,
                first_step,
                next_step,
                more,
                dropped,
            },
        )
        .boxed()
}

fn straggler_settings() -> BoxedStrategy<StragglerSettings> {
    (
        straggler_policy(),
        any::<f32>(),
        any::<u32>(),
        any::<f32>(),
        any::<(u32, u32, u32)>(),
    )
        .prop_map(
            |(policy, factor, window_ms, min_gap_ms, (warmup_ms, stall_ms, stall_drop_ms))| {
                StragglerSettings {
                    policy,
                    factor,
                    window_ms,
                    min_gap_ms,
                    warmup_ms,
                    stall_ms,
                    stall_drop_ms,
                }
            },
        )
        .boxed()
}

fn judgement() -> BoxedStrategy<Judgement> {
    prop_oneof![
        Just(Judgement::Warming),
        Just(Judgement::Ok),
        Just(Judgement::Suspect),
        Just(Judgement::Flagged),
        Just(Judgement::Unjudged),
    ]
    .boxed()
}

fn worker_info() -> BoxedStrategy<WorkerInfo> {
    (
        worker_id(),
        text(),
        text(),
        worker_state(),
        clock(),
        edgy_u64(),
        any::<bool>(),
        f64_no_nan(),
        edgy_u64(),
        (
            f64_no_nan(),
            f64_no_nan(),
            any::<bool>(),
            edgy_u64(),
            proptest::option::of(edgy_u64()),
            proptest::option::of(edgy_u64()),
        ),
        (f64_no_nan(), judgement(), proptest::option::of(edgy_u64())),
    )
        .prop_map(
            |(
                id,
                name,
                addr,
                state,
                clock,
                idle_ms,
                draining,
                steps_per_s,
                samples,
                (step_ms, straggler_score, straggler, staleness, notice_ms, placement),
                (others_ms, judged, stalled_ms),
            )| WorkerInfo {
                id,
                name,
                addr,
                state,
                clock,
                idle_ms,
                draining,
                steps_per_s,
                samples,
                step_ms,
                others_ms,
                straggler_score,
                straggler,
                judged,
                stalled_ms,
                staleness,
                notice_ms,
                placement,
            },
        )
        .boxed()
}

fn shard_stats() -> BoxedStrategy<ShardStats> {
    (
        shard_id(),
        vec(key_range(), 0..5),
        any::<(u64, u64, u64, u64, u64, u64, u64)>(),
        (vec(key_range(), 0..3), any::<u64>()),
    )
        .prop_map(
            |(
                shard,
                ranges,
                (keys, floats, state_bytes, pushes, pulls, bytes_in, bytes_out),
                (backups, lag),
            )| {
                ShardStats {
                    backups,
                    lag,
                    shard,
                    ranges,
                    keys,
                    floats,
                    state_bytes,
                    pushes,
                    pulls,
                    bytes_in,
                    bytes_out,
                }
            },
        )
        .boxed()
}

fn eval_record() -> BoxedStrategy<EvalRecord> {
    (
        edgy_u64(),
        text(),
        clock(),
        f64_no_nan(),
        f64_no_nan(),
        edgy_u64(),
    )
        .prop_map(|(t_ms, name, clock, accuracy, loss, samples)| EvalRecord {
            t_ms,
            name,
            clock,
            accuracy,
            loss,
            samples,
        })
        .boxed()
}

fn job_history() -> BoxedStrategy<JobHistory> {
    let point = (
        edgy_u64(),
        edgy_u64(),
        f64_no_nan(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(|(t_ms, samples, loss_sum, steps, workers)| HistoryPoint {
            t_ms,
            samples,
            loss_sum,
            steps,
            workers,
        });
    (edgy_u64(), vec(point, 0..4), vec(eval_record(), 0..3))
        .prop_map(|(bucket_ms, points, evaluations)| JobHistory {
            bucket_ms,
            points,
            evaluations,
        })
        .boxed()
}

fn wire() -> BoxedStrategy<edl_proto::Wire> {
    proptest::sample::select(edl_proto::Wire::ALL.to_vec()).boxed()
}

fn job_status() -> BoxedStrategy<JobStatus> {
    let epoch = (
        any::<u32>(),
        edgy_u64(),
        f64_no_nan(),
        edgy_u64(),
        edgy_u64(),
    )
        .prop_map(
            |(epoch, samples, loss_sum, bytes_pushed, bytes_pulled)| EpochStats {
                epoch,
                samples,
                loss_sum,
                bytes_pushed,
                bytes_pulled,
            },
        );
    let worker = (
        worker_id(),
        text(),
        worker_state(),
        clock(),
        edgy_u64(),
        any::<bool>(),
    )
        .prop_map(|(id, name, state, clock, idle_ms, draining)| WorkerStatus {
            id,
            name,
            state,
            clock,
            idle_ms,
            draining,
        });
    (
        any::<(u32, u32, u64, u64)>(),
        vec(epoch, 0..3),
        vec(worker, 0..3),
        clock(),
        any::<bool>(),
        edgy_u64(),
        (
            f64_no_nan(),
            proptest::option::of(f64_no_nan()),
            proptest::option::of(eval_record()),
        ),
    )
        .prop_map(
            |(
                (shards_joined, shards_expected, samples_total, samples_done),
                epochs,
                workers,
                min_clock,
                finished,
                t_ms,
                (samples_per_s, loss, evaluation),
            )| JobStatus {
                shards_joined,
                shards_expected,
                samples_total,
                samples_done,
                epochs,
                workers,
                min_clock,
                finished,
                t_ms,
                samples_per_s,
                loss,
                evaluation,
            },
        )
        .boxed()
}

/// Every `Request` variant, with arbitrary field values.
pub fn request() -> BoxedStrategy<Request> {
    prop_oneof![
        (any::<u32>(), text()).prop_map(|(version, name)| Request::Hello { version, name }),
        text().prop_map(|addr| Request::ShardJoin { addr }),
        (text(), proptest::option::of(edgy_u64()))
            .prop_map(|(name, placement)| Request::Register { name, placement }),
        worker_id().prop_map(|worker| Request::Heartbeat { worker }),
        worker_id().prop_map(|worker| Request::Leave { worker }),
        worker_id().prop_map(|worker| Request::NextPartition { worker }),
        (
            worker_id(),
            clock(),
            any::<(u32, u32)>(),
            f64_no_nan(),
            proptest::option::of(data_span()),
            any::<bool>(),
            (edgy_u64(), edgy_u64()),
        )
            .prop_map(
                |(worker, clock, (epoch, samples), loss_sum, span, last, (pushed, pulled))| {
                    Request::Clock {
                        worker,
                        clock,
                        epoch,
                        samples,
                        loss_sum,
                        span,
                        last,
                        bytes_pushed: pushed,
                        bytes_pulled: pulled,
                    }
                },
            ),
        Just(Request::Status),
        Just(Request::GetMap),
        Just(Request::GetJob),
        (worker_id(), edgy_u64())
            .prop_map(|(worker, notice_ms)| Request::Preempt { worker, notice_ms }),
        (worker_id(), proptest::option::of(text()))
            .prop_map(|(worker, slot)| Request::Migrate { worker, slot }),
        any::<u32>().prop_map(|workers| Request::Scale { workers }),
        Just(Request::Placements),
        (edgy_u64(), text()).prop_map(|(id, reason)| Request::PlacementFailed { id, reason }),
        proptest::option::of(straggler_settings()).prop_map(|set| Request::Stragglers { set }),
        (
            map_epoch(),
            vec(key_range(), 0..8),
            clock(),
            proptest::option::of(wire())
        )
            .prop_map(|(epoch, ranges, apply_through, wire)| Request::Pull {
                epoch,
                ranges,
                apply_through,
                wire,
            }),
        (
            map_epoch(),
            worker_id(),
            clock(),
            chunks(),
            proptest::option::of(data_span()),
            token(),
        )
            .prop_map(
                |(epoch, worker, clock, chunks, span, token)| Request::Push {
                    epoch,
                    worker,
                    clock,
                    chunks,
                    span,
                    covers: Vec::new(),
                    token,
                }
            ),
        Just(Request::Ledger),
        worker_id().prop_map(|worker| Request::Drain { worker }),
        edgy_u64().prop_map(|from_step| Request::Trace { from_step }),
        Just(Request::Members),
        Just(Request::ShardStats),
        Just(Request::Checkpoint),
        (any_shard_map(), any::<bool>(), any::<u64>())
            .prop_map(|(map, retire, term)| Request::SetMap { map, retire, term }),
        (
            edgy_u64(),
            edgy_u64(),
            shard_id(),
            any_shard_map(),
            edgy_u64()
        )
            .prop_map(|(start, end, to, map, term)| Request::MoveOut {
                start,
                end,
                to,
                map,
                term,
            }),
        (edgy_u64(), edgy_u64(), any_shard_map()).prop_map(|(start, end, map)| Request::MoveIn {
            start,
            end,
            map
        }),
        Just(Request::KeyLoads),
        Just(Request::ShardList),
        text().prop_map(|addr| Request::ShardAdd { addr }),
        text().prop_map(|shard| Request::ShardRemove { shard }),
        any::<bool>().prop_map(|by_load| Request::Reshard { by_load }),
        (edgy_u64(), edgy_u64(), text()).prop_map(|(start, end, to)| Request::MoveRange {
            start,
            end,
            to
        }),
        (clock(), f64_no_nan(), f64_no_nan(), edgy_u64()).prop_map(
            |(clock, accuracy, loss, samples)| Request::Evaluation {
                clock,
                accuracy,
                loss,
                samples
            }
        ),
        edgy_u64().prop_map(|from_ms| Request::History { from_ms }),
    ]
    .boxed()
}

/// Every `Response` variant, with arbitrary field values.
pub fn response() -> BoxedStrategy<Response> {
    let shard_entry = (shard_id(), text(), text(), 0..3u8).prop_map(|(id, name, addr, role)| {
        let role = match role {
            0 => ShardRole::Active,
            1 => ShardRole::Standby,
            _ => ShardRole::Retired,
        };
        ShardEntry {
            id,
            name,
            addr,
            role,
        }
    });
    let ledger = (any::<u32>(), any::<(u64, u64, u64, u64)>()).prop_map(
        |(epoch, (applied, duplicates, missing, skipped_pushes))| EpochLedger {
            epoch,
            applied,
            duplicates,
            missing,
            skipped_pushes,
        },
    );
    let key_load = (edgy_u64(), edgy_u64()).prop_map(|(key, load)| KeyLoad {
        key: Key(key),
        load,
    });
    prop_oneof![
        (any::<u32>(), text()).prop_map(|(version, role)| Response::Hello { version, role }),
        Just(Response::Ack),
        (any::<bool>(), proptest::option::of(edgy_u64()))
            .prop_map(|(drain, notice_ms)| Response::Beat { drain, notice_ms }),
        vec(placement(), 0..4).prop_map(Response::Placements),
        placement().prop_map(Response::Placed),
        (
            vec(edgy_u64(), 0..4),
            vec(worker_id(), 0..4),
            vec(edgy_u64(), 0..4)
        )
            .prop_map(|(placed, drained, cancelled)| Response::Scaled(Resize {
                placed,
                drained,
                cancelled,
            })),
        straggler_settings().prop_map(Response::Stragglers),
        (shard_id(), job_config(), any_shard_map(), token()).prop_map(
            |(shard, job, map, token_key)| Response::ShardAssigned {
                shard,
                job,
                map,
                token_key,
            }
        ),
        (worker_id(), job_config(), any_shard_map(), clock(), token()).prop_map(
            |(worker, job, map, clock, token)| Response::Registered {
                worker,
                job,
                map,
                clock,
                token,
            }
        ),
        (proptest::option::of(partition()), clock())
            .prop_map(|(partition, clock)| Response::Partition { partition, clock }),
        (clock(), any::<bool>())
            .prop_map(|(min_clock, drain)| Response::ClockGranted { min_clock, drain }),
        job_trace().prop_map(Response::Trace),
        vec(worker_info(), 0..3).prop_map(Response::Members),
        shard_stats().prop_map(Response::ShardStats),
        (text(), edgy_u64(), f64_no_nan()).prop_map(|(path, bytes, millis)| {
            Response::Checkpointed {
                path,
                bytes,
                millis,
            }
        }),
        job_status().prop_map(Response::Status),
        any_shard_map().prop_map(Response::Map),
        job_config().prop_map(Response::Job),
        vec(ledger, 0..4).prop_map(Response::Ledger),
        chunks().prop_map(|chunks| Response::Pulled { chunks }),
        move_report().prop_map(Response::Moved),
        (vec(move_report(), 0..3), any_shard_map())
            .prop_map(|(moves, map)| Response::Resharded { moves, map }),
        vec(key_load, 0..6).prop_map(Response::KeyLoads),
        vec(shard_entry, 0..4).prop_map(Response::ShardList),
        job_history().prop_map(Response::History),
        (any::<u16>(), text(), proptest::option::of(any_shard_map()))
            .prop_map(|(code, message, map)| Response::Error { code, message, map }),
    ]
    .boxed()
}

/// A payload of up to a few hundred bytes (any length, not only whole floats).
pub fn payload() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        1 => Just(Vec::new()),
        3 => vec(any::<u8>(), 0..300),
    ]
    .boxed()
}

fn straggler_policy() -> BoxedStrategy<StragglerPolicy> {
    proptest::sample::select(StragglerPolicy::ALL.to_vec()).boxed()
}

fn placement() -> BoxedStrategy<Placement> {
    let reason = prop_oneof![
        Just(ReplaceReason::Straggler),
        Just(ReplaceReason::Preempt),
        Just(ReplaceReason::Migrate),
    ];
    let kind = prop_oneof![
        Just(PlacementKind::Add),
        (worker_id(), reason).prop_map(|(old, reason)| PlacementKind::Replace { old, reason }),
    ];
    let state = prop_oneof![
        Just(PlacementState::Pending),
        worker_id().prop_map(|worker| PlacementState::Done { worker }),
        text().prop_map(|reason| PlacementState::Failed { reason }),
        Just(PlacementState::Cancelled),
    ];
    (
        edgy_u64(),
        kind,
        proptest::option::of(text()),
        state,
        edgy_u64(),
    )
        .prop_map(|(id, kind, slot, state, t_ms)| Placement {
            id,
            kind,
            slot,
            state,
            t_ms,
        })
        .boxed()
}
