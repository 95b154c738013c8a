//! From the raw tables to a checked `JobConfig`: each section and key checked with its line
//! (`Cx`), optimizer groups matched to tensors, initializers' fans.

use super::*;

/// The file being parsed, for messages.
pub(super) struct Cx<'a> {
    pub(super) text: &'a str,
    pub(super) path: &'a Path,
}

impl Cx<'_> {
    /// The 1-based line holding byte `offset`.
    pub(super) fn line(&self, offset: usize) -> usize {
        spans::line_at(self.text, offset)
    }

    pub(super) fn err(
        &self,
        span: Range<usize>,
        field: &str,
        message: impl Into<String>,
    ) -> JobFileError {
        JobFileError::Invalid {
            path: self.path.to_path_buf(),
            line: (!self.text.is_empty()).then(|| self.line(span.start)),
            field: field.to_owned(),
            message: message.into(),
        }
    }

    pub(super) fn at<T>(
        &self,
        value: &Spanned<T>,
        field: &str,
        message: impl Into<String>,
    ) -> JobFileError {
        self.err(value.span(), field, message)
    }

    /// A TOML syntax or type error, with the field found from its span.
    pub(super) fn toml_error(&self, e: &toml::de::Error) -> JobFileError {
        let message = e.message().trim().to_owned();
        let span = e.span();
        let missing = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'));
        let found = span
            .as_ref()
            .and_then(|s| spans::field_at(self.text, s.start));
        let (line, field) = match (span, missing) {
            // A field missing from the top level has an empty span at the start of the file.
            (Some(s), Some(name)) if s.is_empty() && s.start == 0 => (None, name.to_owned()),
            // Otherwise the span is the header of the table that lacks the field.
            (Some(s), Some(name)) => (
                Some(self.line(s.start)),
                found.map_or_else(|| name.to_owned(), |table| format!("{table}.{name}")),
            ),
            (Some(s), None) => (
                Some(self.line(s.start)),
                found.unwrap_or_else(|| "(toml)".to_owned()),
            ),
            (None, _) => (None, missing.unwrap_or("(toml)").to_owned()),
        };
        JobFileError::Invalid {
            path: self.path.to_path_buf(),
            line,
            field,
            message,
        }
    }

    pub(super) fn data(&self, raw: &Spanned<RawData>) -> Result<DataSpec, JobFileError> {
        let d = raw.get_ref();
        let format = match d.format.get_ref().as_str() {
            "idx" => DataFormat::Idx,
            "libsvm" => DataFormat::LibSvm,
            other => {
                return Err(self.at(
                    &d.format,
                    "data.format",
                    format!("unknown format {other:?}: use idx or libsvm"),
                ));
            }
        };
        let resolve = |p: &Spanned<String>, field: &str| -> Result<String, JobFileError> {
            if p.get_ref().is_empty() {
                return Err(self.at(p, field, "must not be empty"));
            }
            let given = Path::new(p.get_ref());
            if given.is_absolute() {
                return Ok(p.get_ref().clone());
            }
            // Absolute (from the current directory, without resolving links), since workers
            // read the path from the coordinator and may run elsewhere.
            let dir = self.path.parent().unwrap_or(Path::new(""));
            let joined = dir.join(given);
            std::path::absolute(&joined)
                .unwrap_or(joined)
                .to_str()
                .map(str::to_owned)
                .ok_or_else(|| self.at(p, field, "the resolved path is not valid UTF-8"))
        };
        Ok(DataSpec {
            format,
            train: resolve(&d.train, "data.train")?,
            test: match &d.test {
                Some(t) => resolve(t, "data.test")?,
                None => String::new(),
            },
        })
    }

    pub(super) fn model(
        &self,
        raw: &RawJob,
        counts: &mut Counts,
    ) -> Result<(ModelSection, Vec<TensorSpec>), JobFileError> {
        let table = raw.model.get_ref();
        let Some(kind_value) = table.get("kind") else {
            return Err(self.at(
                &raw.model,
                "model.kind",
                format!("missing: say which model, kind = {}", quoted_kinds()),
            ));
        };
        let Some(kind) = kind_value.get_ref().as_str() else {
            return Err(self.at(
                kind_value,
                "model.kind",
                format!("must be a string: {}", quoted_kinds()),
            ));
        };
        if kind == ModelSection::CUSTOM {
            if let Some((key, v)) = table.iter().find(|(k, _)| *k != "kind") {
                let message = match models::taking(key) {
                    Some(k) => format!("only for kind = {:?}", k.name),
                    None => "unknown key: a custom model's tensors are [[tensor]] tables".into(),
                };
                return Err(self.at(v, &format!("model.{key}"), message));
            }
            let list = raw.tensor.as_ref().map(Spanned::get_ref);
            let Some(list) = list.filter(|l| !l.is_empty()) else {
                return Err(self.at(
                    kind_value,
                    "tensor",
                    "missing: a custom model lists its tensors as [[tensor]] tables",
                ));
            };
            return self.custom(list);
        }
        if models::find(kind).is_none() {
            let refused = models::unknown_kind(kind);
            return Err(self.at(kind_value, "model.kind", refused.message));
        }
        // A built-in model's tensors may only be given a wire.
        let tables = raw.tensor.as_ref().map_or(&[][..], |t| t.get_ref());
        for (i, t) in tables.iter().enumerate() {
            let r = t.get_ref();
            let builds = (r.shape.as_ref().map(Spanned::span))
                .or(r.init.as_ref().map(Spanned::span))
                .or(r.scale.as_ref().map(Spanned::span))
                .or(r.value.as_ref().map(Spanned::span));
            if let Some(span) = builds.or_else(|| r.wire.is_none().then(|| t.span())) {
                return Err(self.err(
                    span,
                    &format!("tensor[{i}]"),
                    format!(
                        "kind = {kind:?} builds its own tensors: a [[tensor]] table may only \
                         give one a wire (name and wire); shape and init are for kind = \
                         \"custom\""
                    ),
                ));
            }
        }
        let settings: toml::Table = table
            .iter()
            .filter(|(k, _)| *k != "kind")
            .map(|(k, v)| (k.clone(), v.get_ref().clone()))
            .collect();
        let mut data = ModelData {
            cx: self,
            counts,
            // A count the model sizes from the data is its `features` (see DataShape).
            at: table.get("features").unwrap_or(kind_value).span(),
            error: None,
        };
        let built = models::build(kind, &settings, &mut data);
        let error = data.error.take();
        let model = built.map_err(|e| {
            error.unwrap_or_else(|| {
                let span = table.get(&e.key).unwrap_or(kind_value).span();
                self.err(span, &format!("model.{}", e.key), e.message)
            })
        })?;
        // The check names the setting that sizes the model (the only one a built-in has).
        let sizing = table
            .iter()
            .find(|(k, _)| *k != "kind")
            .map_or((kind_value.span(), "model.kind".to_string()), |(k, v)| {
                (v.span(), format!("model.{k}"))
            });
        self.check_total(&model.tensors, sizing.0, &sizing.1)?;
        Ok((model.section, model.tensors))
    }

    /// Applies the `[training]` table over edl-ps's defaults.
    pub(super) fn training(
        &self,
        t: &RawTraining,
        counts: &mut Counts,
        job: &mut JobConfig,
    ) -> Result<(), JobFileError> {
        let positive = |slot: &mut u32, v: &Option<Spanned<u32>>, field: &str| {
            if let Some(v) = v {
                if *v.get_ref() == 0 {
                    return Err(self.at(v, field, "must be > 0"));
                }
                *slot = *v.get_ref();
            }
            Ok(())
        };
        positive(&mut job.batch_size, &t.batch_size, "training.batch_size")?;
        positive(&mut job.epochs, &t.epochs, "training.epochs")?;
        // A batch larger than a partition is allowed: workers cut batches within a partition.
        positive(
            &mut job.partition_size,
            &t.partition_size,
            "training.partition_size",
        )?;
        positive(&mut job.chunk_size, &t.chunk_size, "training.chunk_size")?;
        if let Some(c) = &t.consistency {
            job.consistency = c
                .get_ref()
                .parse()
                .map_err(|m| self.at(c, "training.consistency", m))?;
        }
        if let Some(s) = &t.samples {
            job.train_samples = match s.get_ref() {
                Count::Fixed(0) => return Err(self.at(s, "training.samples", "must be > 0")),
                Count::Fixed(n) => *n,
                Count::Auto => counts.shape(self, s, "training.samples")?.samples,
            };
        }
        if let Some(v) = &t.lease_ms {
            if *v.get_ref() < MIN_LEASE_MS {
                let message = format!("must be >= {MIN_LEASE_MS}");
                return Err(self.at(v, "training.lease_ms", message));
            }
            job.lease_ms = *v.get_ref();
        }
        if let Some(v) = &t.replicas {
            if !(1..=MAX_REPLICAS).contains(v.get_ref()) {
                let message = format!(
                    "must be 1 (no copies) to {MAX_REPLICAS}, and at most the job's shards"
                );
                return Err(self.at(v, "training.replicas", message));
            }
            job.replicas = *v.get_ref();
        }
        if let Some(v) = &t.wire {
            job.wire = (v.get_ref().parse()).map_err(|e| self.at(v, "training.wire", e))?;
        }
        if let Some(seed) = &t.seed {
            job.seed = seed.get_ref().0;
        }
        Ok(())
    }

    /// The wires `[[tensor]]` tables give their tensors (a built-in model's named by their
    /// names).
    pub(super) fn tensor_wires(
        &self,
        raw: &RawJob,
        tensors: &[TensorSpec],
    ) -> Result<Vec<edl_proto::TensorWire>, JobFileError> {
        let tables = raw.tensor.as_ref().map_or(&[][..], |t| t.get_ref());
        let mut wires = Vec::new();
        for (i, t) in tables.iter().enumerate() {
            let t = t.get_ref();
            let Some(w) = &t.wire else { continue };
            let field = format!("tensor[{i}].wire");
            let wire = (w.get_ref().parse()).map_err(|e| self.at(w, &field, e))?;
            let name = t.name.get_ref();
            let Some(tensor) = tensors.iter().position(|s| &s.name == name) else {
                let names: Vec<&str> = tensors.iter().map(|s| s.name.as_str()).collect();
                return Err(self.at(
                    &t.name,
                    &format!("tensor[{i}].name"),
                    format!(
                        "the model has no tensor {name:?}: it has {}",
                        names.join(", ")
                    ),
                ));
            };
            if wires
                .iter()
                .any(|w: &edl_proto::TensorWire| w.tensor as usize == tensor)
            {
                return Err(self.at(
                    &t.name,
                    &format!("tensor[{i}].name"),
                    format!("tensor {name:?} is given a wire twice"),
                ));
            }
            wires.push(edl_proto::TensorWire {
                tensor: tensor as u32,
                wire,
            });
        }
        Ok(wires)
    }

    pub(super) fn check_total(
        &self,
        tensors: &[TensorSpec],
        span: Range<usize>,
        field: &str,
    ) -> Result<(), JobFileError> {
        let total = tensors.iter().fold(0u64, |n, t| n.saturating_add(t.len()));
        if total > MAX_PARAMETERS {
            return Err(self.err(
                span,
                field,
                format!(
                    "the model has {total} parameters, more than the limit of \
                     {MAX_PARAMETERS} (2^31) floats"
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn custom(
        &self,
        list: &[Spanned<RawTensor>],
    ) -> Result<(ModelSection, Vec<TensorSpec>), JobFileError> {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        let mut tensors = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let t = t.get_ref();
            let field = |k: &str| format!("tensor[{i}].{k}");
            let name = t.name.get_ref();
            if name.is_empty() {
                return Err(self.at(&t.name, &field("name"), "must not be empty"));
            }
            if name.chars().any(char::is_whitespace) {
                return Err(self.at(
                    &t.name,
                    &field("name"),
                    format!("{name:?} contains whitespace"),
                ));
            }
            if let Some(j) = seen.insert(name, i) {
                return Err(self.at(
                    &t.name,
                    &field("name"),
                    format!("{name:?} is already the name of tensor[{j}]"),
                ));
            }
            let (Some(dims), Some(init)) = (&t.shape, &t.init) else {
                let key = if t.shape.is_none() { "shape" } else { "init" };
                return Err(self.at(&t.name, &field(key), "missing: a custom tensor needs one"));
            };
            if dims.get_ref().is_empty() {
                return Err(self.at(dims, &field("shape"), "must have at least one dim"));
            }
            if let Some((d, dim)) = dims
                .get_ref()
                .iter()
                .enumerate()
                .find(|(_, d)| *d.get_ref() == 0)
            {
                return Err(self.at(dim, &field("shape"), format!("dim {d} is 0; must be > 0")));
            }
            let shape: Vec<u32> = dims.get_ref().iter().map(|d| *d.get_ref()).collect();
            let init = self.init(t, init, &shape, &field)?;
            tensors.push(TensorSpec {
                name: name.clone(),
                shape,
                init,
            });
            self.check_total(&tensors, dims.span(), &field("shape"))?;
        }
        Ok((ModelSection::custom(), tensors))
    }

    pub(super) fn init(
        &self,
        t: &RawTensor,
        init: &Spanned<String>,
        shape: &[u32],
        field: &dyn Fn(&str) -> String,
    ) -> Result<Init, JobFileError> {
        let kind = init.get_ref().as_str();
        let forbid = |v: &Option<Spanned<f32>>, key: &str| match v {
            Some(v) => Err(self.at(v, &field(key), format!("not used by init = {kind:?}"))),
            None => Ok(()),
        };
        let required = |v: &Option<Spanned<f32>>, key: &str, positive: bool| match v {
            None => Err(self.at(
                init,
                &field(key),
                format!("missing: init = {kind:?} needs {key}"),
            )),
            Some(v) if !v.get_ref().is_finite() => {
                Err(self.at(v, &field(key), "must be a finite number"))
            }
            Some(v) if positive && *v.get_ref() <= 0.0 => {
                Err(self.at(v, &field(key), "must be > 0"))
            }
            Some(v) => Ok(*v.get_ref()),
        };
        let init = match kind {
            "zeros" => {
                forbid(&t.scale, "scale")?;
                forbid(&t.value, "value")?;
                Init::Zeros
            }
            "constant" => {
                forbid(&t.scale, "scale")?;
                Init::Constant {
                    value: required(&t.value, "value", false)?,
                }
            }
            "uniform" => {
                forbid(&t.value, "value")?;
                Init::Uniform {
                    limit: required(&t.scale, "scale", true)?,
                }
            }
            "normal" => {
                forbid(&t.value, "value")?;
                Init::Normal {
                    std: required(&t.scale, "scale", true)?,
                }
            }
            _ => match fan_init(kind, shape) {
                Some(init) => {
                    forbid(&t.scale, "scale")?;
                    forbid(&t.value, "value")?;
                    init
                }
                None => {
                    return Err(self.at(
                        init,
                        &field("init"),
                        format!(
                            "unknown init {kind:?}: use zeros, constant, uniform, normal, \
                             glorot_uniform, glorot_normal, he_uniform or he_normal"
                        ),
                    ));
                }
            },
        };
        Ok(init)
    }

    pub(super) fn optimizer(
        &self,
        raw: Option<&Spanned<RawOptimizer>>,
        tensors: &[TensorSpec],
    ) -> Result<(OptimizerSpec, Vec<OptimizerGroup>), JobFileError> {
        let Some(raw) = raw else {
            return Ok((defaults::OPTIMIZER, Vec::new()));
        };
        let table = raw.get_ref();
        let kinds = OptimizerSpec::KINDS.join(", ");
        let Some(kind_value) = table.get("kind") else {
            return Err(self.at(
                raw,
                "optimizer.kind",
                format!("missing: say which optimizer, one of {kinds}"),
            ));
        };
        let Some(kind) = kind_value.get_ref().as_str() else {
            return Err(self.at(
                kind_value,
                "optimizer.kind",
                format!("must be a string: {kinds}"),
            ));
        };
        // The kind alone is the optimizer with PyTorch's defaults.
        let Some(mut spec) = OptimizerSpec::defaults(kind) else {
            return Err(self.at(
                kind_value,
                "optimizer.kind",
                format!("unknown optimizer {kind:?}: use {kinds}"),
            ));
        };
        for (key, v) in table.iter().filter(|(k, _)| *k != "kind" && *k != "group") {
            set_optimizer_key(&mut spec, key, v.get_ref())
                .map_err(|m| self.at(v, &format!("optimizer.{key}"), m))?;
        }
        spec.check()
            .map_err(|m| self.at(kind_value, "optimizer", m))?;
        let groups = match table.get("group") {
            None => Vec::new(),
            Some(v) => self.optimizer_groups(v, &spec, tensors)?,
        };
        Ok((spec, groups))
    }

    /// The `[schedule]` table over a constant schedule.
    pub(super) fn schedule(&self, raw: &Spanned<RawSchedule>) -> Result<LrSchedule, JobFileError> {
        let table = raw.get_ref();
        let kinds = Curve::KINDS.join(", ");
        let kind = match table.get("kind") {
            None => "constant",
            Some(v) => v
                .get_ref()
                .as_str()
                .ok_or_else(|| self.at(v, "schedule.kind", format!("must be a string: {kinds}")))?,
        };
        let Some(curve) = Curve::defaults(kind) else {
            let at = table.get("kind").map_or(raw.span(), Spanned::span);
            return Err(self.err(
                at,
                "schedule.kind",
                format!("unknown schedule {kind:?}: use {kinds}"),
            ));
        };
        let mut schedule = LrSchedule {
            curve,
            ..LrSchedule::default()
        };
        for (key, v) in table.iter().filter(|(k, _)| *k != "kind") {
            let field = format!("schedule.{key}");
            let value = match v.get_ref() {
                toml::Value::Integer(i) => SettingValue::Number(*i as f64),
                toml::Value::Float(x) => SettingValue::Number(*x),
                toml::Value::Boolean(b) => SettingValue::Flag(*b),
                toml::Value::String(w) => SettingValue::Word(w.clone()),
                toml::Value::Array(list) => SettingValue::Counts(
                    list.iter()
                        .map(|m| m.as_integer().and_then(|i| u64::try_from(i).ok()))
                        .collect::<Option<_>>()
                        .ok_or_else(|| self.at(v, &field, "must be whole numbers >= 0"))?,
                ),
                other => {
                    return Err(self.at(v, &field, format!("cannot be a {}", other.type_str())));
                }
            };
            if !schedule
                .set(key, value)
                .map_err(|m| self.at(v, &field, m))?
            {
                let keys = edl_proto::schedule::schedule_keys(kind).join(", ");
                return Err(self.at(
                    v,
                    &field,
                    format!("unknown key: kind = {kind:?} takes {keys}"),
                ));
            }
        }
        schedule
            .curve
            .check()
            .map_err(|m| self.at(raw, "schedule", m))?;
        Ok(schedule)
    }

    /// `[[optimizer.group]]` tables: `tensors` (names, or patterns with `*`) and settings
    /// over the job's optimizer, as PyTorch's parameter groups.
    pub(super) fn optimizer_groups(
        &self,
        v: &Spanned<toml::Value>,
        base: &OptimizerSpec,
        tensors: &[TensorSpec],
    ) -> Result<Vec<OptimizerGroup>, JobFileError> {
        let toml::Value::Array(list) = v.get_ref() else {
            return Err(self.at(v, "optimizer.group", "must be [[optimizer.group]] tables"));
        };
        let mut groups = Vec::with_capacity(list.len());
        let mut owner: HashMap<u32, usize> = HashMap::new();
        for (i, g) in list.iter().enumerate() {
            let field = |k: &str| format!("optimizer.group[{i}].{k}");
            let err = |k: &str, m: String| self.at(v, &field(k), m);
            let Some(g) = g.as_table() else {
                return Err(err("", "must be a table".into()));
            };
            let Some(names) = g.get("tensors").and_then(toml::Value::as_array) else {
                return Err(err(
                    "tensors",
                    "missing: a group names its tensors, e.g. tensors = [\"*.bias\"]".into(),
                ));
            };
            let mut members = Vec::new();
            for name in names {
                let Some(pattern) = name.as_str() else {
                    return Err(err("tensors", format!("{name} is not a tensor name")));
                };
                let hits: Vec<u32> = (0..tensors.len() as u32)
                    .filter(|&t| glob_match(pattern, &tensors[t as usize].name))
                    .collect();
                if hits.is_empty() {
                    return Err(err(
                        "tensors",
                        format!("{pattern:?} names no tensor of the model"),
                    ));
                }
                for t in hits {
                    if let Some(j) = owner.insert(t, i).filter(|&j| j != i) {
                        return Err(err(
                            "tensors",
                            format!(
                                "{:?} is already in group {j}: a tensor is in one group",
                                tensors[t as usize].name
                            ),
                        ));
                    }
                    if !members.contains(&t) {
                        members.push(t);
                    }
                }
            }
            let mut spec = base.clone();
            for (key, value) in g.iter().filter(|(k, _)| *k != "tensors") {
                if key == "kind" {
                    return Err(err(
                        key,
                        "a group keeps the job's optimizer kind; it changes its settings".into(),
                    ));
                }
                set_optimizer_key(&mut spec, key, value).map_err(|m| err(key, m))?;
            }
            spec.check().map_err(|m| err("", m))?;
            groups.push(OptimizerGroup {
                tensors: members,
                optimizer: spec,
            });
        }
        Ok(groups)
    }
}

/// Sets optimizer setting `key` of `spec`'s kind from a job file's value; the message names
/// what is wrong (the kinds that take a key this kind does not).
pub(super) fn set_optimizer_key(
    spec: &mut OptimizerSpec,
    key: &str,
    v: &toml::Value,
) -> Result<(), String> {
    let kind = spec.kind();
    let keys = OptimizerSpec::keys(kind);
    if key != "lr" && !keys.contains(&key) {
        let owners: Vec<String> = OptimizerSpec::KINDS
            .iter()
            .filter(|k| OptimizerSpec::keys(k).contains(&key))
            .map(|k| format!("{k:?}"))
            .collect();
        return Err(if owners.is_empty() {
            format!("unknown key: kind = {kind:?} takes lr, {}", keys.join(", "))
        } else {
            format!("only for kind = {}", owners.join(" or "))
        });
    }
    let set = match v {
        toml::Value::Boolean(on) => spec.set_flag(key, *on)?,
        toml::Value::Float(x) => spec.set_number(key, *x)?,
        toml::Value::Integer(i) => spec.set_number(key, *i as f64)?,
        other => {
            return Err(format!(
                "must be a number or a boolean, not a {}",
                other.type_str()
            ));
        }
    };
    if !set {
        let want = if v.is_bool() {
            "a number"
        } else {
            "true or false"
        };
        return Err(format!("must be {want}"));
    }
    Ok(())
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters.
pub(super) fn glob_match(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else {
                return false;
            };
            (0..=tail.len())
                .filter(|&i| tail.is_char_boundary(i))
                .any(|i| glob_match(rest, &tail[i..]))
        }
    }
}

/// The fans of a tensor under the `[in, out, receptive...]` convention: `[a]` has both fans
/// `a`; `[a, b, rest...]` has `a * prod(rest)` in and `b * prod(rest)` out.
pub(super) fn fans(shape: &[u32]) -> (f64, f64) {
    match shape {
        [] => (1.0, 1.0),
        [a] => (f64::from(*a), f64::from(*a)),
        [a, b, rest @ ..] => {
            let receptive: f64 = rest.iter().map(|&d| f64::from(d)).product();
            (f64::from(*a) * receptive, f64::from(*b) * receptive)
        }
    }
}

/// Resolves a Glorot or He init from the tensor's fans; `None` for other names.
pub(super) fn fan_init(kind: &str, shape: &[u32]) -> Option<Init> {
    let (fan_in, fan_out) = fans(shape);
    let init = match kind {
        "glorot_uniform" => Init::Uniform {
            limit: (6.0 / (fan_in + fan_out)).sqrt() as f32,
        },
        "glorot_normal" => Init::Normal {
            std: (2.0 / (fan_in + fan_out)).sqrt() as f32,
        },
        "he_uniform" => Init::Uniform {
            limit: (6.0 / fan_in).sqrt() as f32,
        },
        "he_normal" => Init::Normal {
            std: (2.0 / fan_in).sqrt() as f32,
        },
        _ => return None,
    };
    Some(init)
}
