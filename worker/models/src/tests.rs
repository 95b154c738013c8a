use super::*;

fn table(text: &str) -> toml::Table {
    text.parse().expect("test TOML")
}

struct Features(u32);

impl DataShape for Features {
    fn features(&mut self) -> Result<u32, String> {
        Ok(self.0)
    }
}

#[test]
fn every_builtin_round_trips_through_its_wire_section() {
    let mlp = Mlp {
        layers: vec![784, 256, 10],
    };
    let section = mlp.section();
    assert_eq!(section.kind, "mlp");
    assert_eq!(Mlp::from_section(&section), Ok(mlp.clone()));
    let m = resolve(&section)
        .expect("a valid section")
        .expect("a built-in model");
    assert_eq!(m.tensors, mlp.tensors());
    assert_eq!(m.description, "mlp 784-256-10");
    assert_eq!(m.section, section);

    let lr = LogReg { features: 126 };
    assert_eq!(LogReg::from_section(&lr.section()), Ok(lr.clone()));
    assert_eq!(describe(&lr.section(), &[]), "logreg over 126 features");
    // The registry lists both, each under the name its type carries.
    assert_eq!(find("mlp").map(|k| k.keys), Some(Mlp::KEYS));
    assert_eq!(find("logreg").map(|k| k.keys), Some(LogReg::KEYS));
    assert_eq!(kinds(), "mlp, logreg or custom");
}

#[test]
fn mlp_tensors_are_glorot_weights_and_zero_biases_in_layer_order() {
    let t = Mlp {
        layers: vec![4, 3, 2],
    }
    .tensors();
    let names: Vec<&str> = t.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"]);
    assert_eq!(t[0].shape, [4, 3]);
    assert_eq!(t[3].shape, [2]);
    let limit = (6.0f64 / 7.0).sqrt() as f32;
    assert_eq!(t[0].init, edl_proto::Init::Uniform { limit });
    assert_eq!(t[1].init, edl_proto::Init::Zeros);
}

#[test]
fn auto_features_are_sized_from_the_data_and_resolved_on_the_wire() {
    let m = build("logreg", &table("features = \"auto\""), &mut Features(12)).expect("sized");
    assert_eq!(m.section.settings.trim(), "features = 12");
    assert_eq!(m.tensors, LogReg { features: 12 }.tensors());
    // Off the wire there is no data: a section must carry the resolved count.
    let unresolved = ModelSection {
        kind: "logreg".into(),
        settings: "features = \"auto\"".into(),
    };
    let e = resolve(&unresolved).expect_err("no data off the wire");
    assert!(e.contains("needs the job's training data"), "{e}");
    let e =
        build("logreg", &table("features = \"auto\""), &mut Features(0)).expect_err("no features");
    assert_eq!(
        e,
        SettingError::new("features", "the training data has no features")
    );
}

#[test]
fn bad_settings_name_their_key() {
    let cases: &[(&str, &str, &str, &str)] = &[
        ("mlp", "", "layers", "missing: an mlp needs"),
        ("mlp", "layers = [784]", "layers", "at least 2 widths"),
        ("mlp", "layers = [784, 0, 10]", "layers", "width 1 is 0"),
        ("mlp", "layers = [784, -3]", "layers", "width 1 is -3"),
        ("mlp", "layers = [784, 1e9]", "layers", "not a float"),
        ("mlp", "layers = 784", "layers", "must be an array"),
        (
            "mlp",
            "layers = [784, 10]\nfeatures = 3",
            "features",
            "only for kind = \"logreg\"",
        ),
        (
            "mlp",
            "layers = [784, 10]\ndepth = 3",
            "depth",
            "kind = \"mlp\" takes `layers`",
        ),
        ("logreg", "", "features", "missing: a logreg needs"),
        ("logreg", "features = 0", "features", "must be > 0"),
        ("logreg", "features = \"many\"", "features", "not \"many\""),
        (
            "logreg",
            "features = 5000000000",
            "features",
            "must be in 1..=",
        ),
        (
            "cnn",
            "",
            "kind",
            "unknown model kind \"cnn\": use mlp, logreg or custom",
        ),
    ];
    for &(kind, text, key, message) in cases {
        let e = build(kind, &table(text), &mut NoData).expect_err(text);
        assert_eq!(e.key, key, "{kind} {text:?}: {e}");
        assert!(e.message.contains(message), "{kind} {text:?}: {e}");
    }
}

#[test]
fn sections_off_the_wire_are_checked_not_trusted() {
    let bad = [
        ("mlp", "layers = [784"),
        ("mlp", ""),
        ("logreg", "features = 1\nlayers = [1, 2]"),
        ("transformer", "heads = 8"),
        ("", ""),
    ];
    for (kind, settings) in bad {
        let s = ModelSection {
            kind: kind.into(),
            settings: settings.into(),
        };
        assert!(resolve(&s).is_err(), "{s:?}");
        // Described as it came, never a panic.
        assert!(describe(&s, &[]).starts_with(kind), "{s:?}");
    }
    assert_eq!(resolve(&ModelSection::custom()), Ok(None));
    assert!(Mlp::from_section(&LogReg { features: 3 }.section()).is_err());
}

#[test]
fn custom_models_are_described_by_their_tensors() {
    let t = Mlp { layers: vec![2, 2] }.tensors();
    assert_eq!(describe(&ModelSection::custom(), &t), "custom (2 tensors)");
    assert_eq!(
        describe(&ModelSection::custom(), &t[..1]),
        "custom (1 tensor)"
    );
}
