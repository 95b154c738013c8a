//! The job file as TOML gives it: the raw tables before anything is checked, sample counts
//! (`auto`, or counted in the data) and seeds.

use super::*;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJob {
    pub(super) model: Spanned<RawModel>,
    pub(super) optimizer: Option<Spanned<RawOptimizer>>,
    pub(super) schedule: Option<Spanned<RawSchedule>>,
    pub(super) training: Option<Spanned<RawTraining>>,
    pub(super) data: Option<Spanned<RawData>>,
    pub(super) tensor: Option<Spanned<Vec<Spanned<RawTensor>>>>,
    pub(super) worker: Option<Spanned<worker::RawWorker>>,
}

/// The `[model]` table: `kind` and the kind's settings, which the model registry reads.
pub(super) type RawModel = BTreeMap<String, Spanned<toml::Value>>;

/// The `[optimizer]` table: `kind` and torch.optim's arguments of that kind.
pub(super) type RawOptimizer = BTreeMap<String, Spanned<toml::Value>>;

/// The `[schedule]` table: `kind`, the scheduler's arguments, `by` and `scale`.
pub(super) type RawSchedule = BTreeMap<String, Spanned<toml::Value>>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTraining {
    pub(super) consistency: Option<Spanned<String>>,
    pub(super) batch_size: Option<Spanned<u32>>,
    pub(super) epochs: Option<Spanned<u32>>,
    pub(super) samples: Option<Spanned<Count>>,
    pub(super) partition_size: Option<Spanned<u32>>,
    pub(super) lease_ms: Option<Spanned<u32>>,
    pub(super) replicas: Option<Spanned<u32>>,
    pub(super) wire: Option<Spanned<String>>,
    pub(super) seed: Option<Spanned<Seed>>,
    pub(super) chunk_size: Option<Spanned<u32>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawData {
    pub(super) format: Spanned<String>,
    pub(super) train: Spanned<String>,
    pub(super) test: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTensor {
    pub(super) name: Spanned<String>,
    pub(super) shape: Option<Spanned<Vec<Spanned<u32>>>>,
    pub(super) init: Option<Spanned<String>>,
    pub(super) scale: Option<Spanned<f32>>,
    pub(super) value: Option<Spanned<f32>>,
    pub(super) wire: Option<Spanned<String>>,
}

/// A count given as a number or as `"auto"` (taken from the training data).
pub(super) enum Count {
    Auto,
    Fixed(u32),
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a positive integer or \"auto\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Count, E> {
                u32::try_from(v)
                    .map(Count::Fixed)
                    .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Count, E> {
                u32::try_from(v)
                    .map(Count::Fixed)
                    .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Count, E> {
                match v {
                    "auto" => Ok(Count::Auto),
                    _ => Err(E::invalid_value(Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A seed: a TOML integer, or a decimal string for seeds above `i64::MAX` (TOML integers are
/// signed 64-bit).
pub(super) struct Seed(pub(super) u64);

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seed;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a non-negative integer (or a decimal string above 2^63)")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seed, E> {
                u64::try_from(v)
                    .map(Seed)
                    .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Seed, E> {
                v.parse()
                    .map(Seed)
                    .map_err(|_| E::invalid_value(Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

/// The training data's shape, scanned at most once and only when a count is `auto`.
pub(super) struct Counts {
    /// The LIBSVM training file and the span of `data.train`; `None` without libsvm data.
    pub(super) train: Option<(PathBuf, Range<usize>)>,
    pub(super) shape: Option<libsvm::Shape>,
}

impl Counts {
    pub(super) fn shape<T>(
        &mut self,
        cx: &Cx<'_>,
        at: &Spanned<T>,
        field: &str,
    ) -> Result<libsvm::Shape, JobFileError> {
        self.shape_at(cx, at.span(), field)
    }

    pub(super) fn shape_at(
        &mut self,
        cx: &Cx<'_>,
        at: Range<usize>,
        field: &str,
    ) -> Result<libsvm::Shape, JobFileError> {
        if let Some(shape) = self.shape {
            return Ok(shape);
        }
        let Some((train, span)) = &self.train else {
            return Err(cx.err(
                at,
                field,
                "\"auto\" needs libsvm training data to count: add [data] with format = \"libsvm\"",
            ));
        };
        let shape = libsvm::scan(train).map_err(|e| {
            cx.err(
                span.clone(),
                "data.train",
                format!("cannot count the training data for {field} = \"auto\": {e}"),
            )
        })?;
        self.shape = Some(shape);
        Ok(shape)
    }
}

/// The training data as a built-in model sizes itself from it; the job file's own error
/// (with its line) is kept for the caller.
pub(super) struct ModelData<'c, 'a> {
    pub(super) cx: &'c Cx<'a>,
    pub(super) counts: &'c mut Counts,
    /// Where the count the model asks for is written, for errors.
    pub(super) at: Range<usize>,
    pub(super) error: Option<JobFileError>,
}

impl models::DataShape for ModelData<'_, '_> {
    fn features(&mut self) -> Result<u32, String> {
        // The model's setting that asked is `features` (the one count a model takes).
        let at = self.at.clone();
        match self.counts.shape_at(self.cx, at, "model.features") {
            Ok(shape) => Ok(shape.features),
            Err(e) => {
                let message = e.to_string();
                self.error = Some(e);
                Err(message)
            }
        }
    }
}

/// The model kinds as a job file writes them: `"mlp", "logreg" or "custom"`.
pub(super) fn quoted_kinds() -> String {
    let names: Vec<String> = models::BUILTINS
        .iter()
        .map(|k| format!("{:?}", k.name))
        .collect();
    format!("{} or {:?}", names.join(", "), ModelSection::CUSTOM)
}
