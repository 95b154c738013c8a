//! A `JobConfig` written back: the TOML a job file would hold (`to_toml`) and the
//! description `edl-ps job check` prints.

use super::*;

/// A float as TOML: `Debug` always writes a `.` or an exponent and the shortest digits that
/// read back to the same `f32`.
pub(super) fn toml_float(x: f32) -> String {
    if x.is_nan() {
        "nan".to_owned()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.to_owned()
    } else {
        format!("{x:?}")
    }
}

/// A TOML basic string.
pub(super) fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

pub(super) fn join<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `lr` and every other setting of `o`, a line each.
pub(super) fn write_optimizer_settings(out: &mut String, o: &OptimizerSpec) -> fmt::Result {
    writeln!(out, "lr = {:?}", o.lr())?;
    for (key, value) in o.settings_text() {
        writeln!(out, "{key} = {value}")?;
    }
    Ok(())
}

pub(super) fn write_toml(out: &mut String, job: &JobConfig) -> fmt::Result {
    writeln!(out, "[model]")?;
    writeln!(out, "kind = {}", toml_string(&job.model.kind))?;
    // The registry's settings are TOML already (a custom model has none).
    let settings = job.model.settings.trim_end();
    if !settings.is_empty() {
        writeln!(out, "{settings}")?;
    }
    writeln!(out, "\n[optimizer]")?;
    writeln!(out, "kind = \"{}\"", job.optimizer.kind())?;
    write_optimizer_settings(out, &job.optimizer)?;
    for g in &job.optimizer_groups {
        let names: Vec<String> = g
            .tensors
            .iter()
            .filter_map(|&t| job.tensors.get(t as usize))
            .map(|t| toml_string(&t.name))
            .collect();
        writeln!(
            out,
            "\n[[optimizer.group]]\ntensors = [{}]",
            names.join(", ")
        )?;
        write_optimizer_settings(out, &g.optimizer)?;
    }
    if job.schedule != LrSchedule::default() {
        writeln!(out, "\n[schedule]")?;
        writeln!(out, "kind = \"{}\"", job.schedule.curve.kind())?;
        for (key, value) in job.schedule.curve.settings_text() {
            writeln!(out, "{key} = {value}")?;
        }
        writeln!(out, "by = \"{}\"", job.schedule.by)?;
        writeln!(out, "scale = \"{}\"", job.schedule.scale)?;
    }
    writeln!(out, "\n[training]")?;
    writeln!(out, "consistency = \"{}\"", job.consistency)?;
    writeln!(out, "batch_size = {}", job.batch_size)?;
    writeln!(out, "epochs = {}", job.epochs)?;
    writeln!(out, "samples = {}", job.train_samples)?;
    writeln!(out, "partition_size = {}", job.partition_size)?;
    writeln!(out, "lease_ms = {}", job.lease_ms)?;
    if job.replicas != defaults::REPLICAS {
        writeln!(out, "replicas = {}", job.replicas)?;
    }
    if !job.wire.is_exact() {
        writeln!(out, "wire = \"{}\"", job.wire)?;
    }
    if i64::try_from(job.seed).is_ok() {
        writeln!(out, "seed = {}", job.seed)?;
    } else {
        writeln!(out, "seed = \"{}\"", job.seed)?;
    }
    writeln!(out, "chunk_size = {}", job.chunk_size)?;
    if let Some(data) = &job.data {
        writeln!(out, "\n[data]")?;
        writeln!(out, "format = \"{}\"", data.format)?;
        writeln!(out, "train = {}", toml_string(&data.train))?;
        if !data.test.is_empty() {
            writeln!(out, "test = {}", toml_string(&data.test))?;
        }
    }
    let own_wire = |t: usize| job.tensor_wires.iter().find(|w| w.tensor as usize == t);
    if job.model.is_custom() {
        for (i, t) in job.tensors.iter().enumerate() {
            writeln!(out, "\n[[tensor]]")?;
            writeln!(out, "name = {}", toml_string(&t.name))?;
            if let Some(w) = own_wire(i) {
                writeln!(out, "wire = \"{}\"", w.wire)?;
            }
            writeln!(out, "shape = [{}]", join(&t.shape))?;
            match t.init {
                Init::Zeros => writeln!(out, "init = \"zeros\"")?,
                Init::Uniform { limit } => {
                    writeln!(out, "init = \"uniform\"\nscale = {}", toml_float(limit))?;
                }
                Init::Normal { std } => {
                    writeln!(out, "init = \"normal\"\nscale = {}", toml_float(std))?;
                }
                Init::Constant { value } => {
                    writeln!(out, "init = \"constant\"\nvalue = {}", toml_float(value))?;
                }
            }
        }
    } else {
        for w in &job.tensor_wires {
            if let Some(t) = job.tensors.get(w.tensor as usize) {
                writeln!(out, "\n[[tensor]]")?;
                writeln!(out, "name = {}", toml_string(&t.name))?;
                writeln!(out, "wire = \"{}\"", w.wire)?;
            }
        }
    }
    Ok(())
}

/// The parameter groups, one line each: their tensors and what differs from the job's.
pub(super) fn groups_text(job: &JobConfig) -> String {
    if job.optimizer_groups.is_empty() {
        return "none".into();
    }
    let base = job.optimizer.settings_text();
    job.optimizer_groups
        .iter()
        .map(|g| {
            let names: Vec<&str> = g
                .tensors
                .iter()
                .filter_map(|&t| job.tensors.get(t as usize))
                .map(|t| t.name.as_str())
                .collect();
            let mut changed: Vec<String> = Vec::new();
            if g.optimizer.lr().to_bits() != job.optimizer.lr().to_bits() {
                changed.push(format!("lr {}", g.optimizer.lr()));
            }
            for ((key, value), (_, was)) in g.optimizer.settings_text().into_iter().zip(&base) {
                if value != *was {
                    changed.push(format!("{key} {value}"));
                }
            }
            format!("{}: {}", names.join(", "), changed.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

pub(super) fn optimizer_text(o: &OptimizerSpec) -> String {
    let mut out = format!("{}, lr {}", o.kind(), o.lr());
    for (key, value) in o.changed_settings() {
        let _ = write!(out, ", {key} {value}");
    }
    out
}

/// How a job's pushes and pulls travel, for its description.
pub(super) fn wire_text(wire: edl_proto::WireSpec) -> String {
    let values = match wire.values {
        edl_proto::Wire::F32 => "at f32".to_string(),
        w => format!("at 16 bits ({w})"),
    };
    match wire.topk {
        None if wire.is_exact() => "f32 (pushes and pulls exact)".to_string(),
        None => format!("{wire} (pushes and pulls {values}; shards keep f32)"),
        Some(k) => format!(
            "{wire} (each push sends the largest {}% of every chunk's values {values}, the \
             rest held back by the worker for its next push; pulls {values})",
            k.fraction() * 100.0
        ),
    }
}

/// The tensors that travel at a wire of their own, for a job's description.
pub(super) fn tensor_wires_text(job: &JobConfig) -> String {
    let named = job.tensor_wires.iter().map(|w| {
        let name = job.tensors.get(w.tensor as usize).map_or("?", |t| &t.name);
        format!("{name} {}", wire_text(w.wire))
    });
    named.collect::<Vec<_>>().join("; ")
}

pub(super) fn write_description(out: &mut String, job: &JobConfig) -> fmt::Result {
    let partitions = job.train_samples.div_ceil(job.partition_size.max(1));
    let settings = [
        ("model", models::describe(&job.model, &job.tensors)),
        ("optimizer", optimizer_text(&job.optimizer)),
        ("groups", groups_text(job)),
        ("schedule", job.schedule.to_string()),
        ("consistency", job.consistency.to_string()),
        ("batch size", format!("{} samples", job.batch_size)),
        ("epochs", job.epochs.to_string()),
        ("samples", format!("{} per epoch", job.train_samples)),
        (
            "partitions",
            format!(
                "{} samples each, {partitions} per epoch",
                job.partition_size
            ),
        ),
        ("lease", format!("{} ms", job.lease_ms)),
        (
            "replicas",
            match job.replicas {
                0 | 1 => "1 (no backup copies)".to_string(),
                n => format!("{n} (a primary and {} backups of every key range)", n - 1),
            },
        ),
        ("wire", wire_text(job.wire)),
        ("tensor wires", tensor_wires_text(job)),
        ("seed", job.seed.to_string()),
        ("chunk size", format!("{} floats per key", job.chunk_size)),
        (
            "data",
            match &job.data {
                None => "not named (workers are told where it lies)".to_owned(),
                Some(d) if d.test.is_empty() => format!("{}: train {}", d.format, d.train),
                Some(d) => format!("{}: train {}, test {}", d.format, d.train, d.test),
            },
        ),
    ];
    for (name, value) in settings {
        // Most jobs have no parameter groups: no line for them.
        if name == "groups" && job.optimizer_groups.is_empty() {
            continue;
        }
        if name == "tensor wires" && job.tensor_wires.is_empty() {
            continue;
        }
        if name == "schedule" && job.schedule == LrSchedule::default() {
            continue;
        }
        writeln!(out, "{name:<12} {value}")?;
    }

    let mut keys = vec![0u64; job.tensors.len()];
    let layout = job.layout();
    for span in layout.spans() {
        if let Some(k) = keys.get_mut(span.tensor) {
            *k += 1;
        }
    }
    let mut rows = vec![[
        "tensor".to_owned(),
        "shape".to_owned(),
        "init".to_owned(),
        "offset".to_owned(),
        "floats".to_owned(),
        "keys".to_owned(),
    ]];
    let mut offset = 0u64;
    for (t, k) in job.tensors.iter().zip(&keys) {
        let shape: Vec<String> = t.shape.iter().map(u32::to_string).collect();
        rows.push([
            t.name.clone(),
            format!("[{}]", shape.join(", ")),
            t.init.to_string(),
            offset.to_string(),
            t.len().to_string(),
            k.to_string(),
        ]);
        offset = offset.saturating_add(t.len());
    }
    let mut width = [0usize; 6];
    for row in &rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    writeln!(out)?;
    for row in &rows {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(width).enumerate() {
            // Names, shapes and inits align left, numbers right.
            if i < 3 {
                write!(line, "{cell:<w$}  ")?;
            } else {
                write!(line, "{cell:>w$}  ")?;
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    let total = layout.total_len();
    let bytes = total.saturating_mul(4);
    writeln!(
        out,
        "\ntotal: {total} parameters, {bytes} bytes ({}), {} keys",
        human_bytes(bytes),
        layout.num_keys()
    )
}
