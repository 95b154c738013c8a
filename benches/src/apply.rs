//! `edl-bench apply`: the server-side optimizers' throughput, in GB/s of parameter plus
//! gradient bytes, against a memcpy of the same bytes in the same run.

use std::time::Instant;

use edl_ps::optimizer::OptState;
use edl_shared::proto::OptimizerSpec;
use serde::Serialize;

use crate::stats::gbps;

/// One optimizer's throughput.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The optimizer and its distinguishing settings.
    pub optimizer: String,
    /// Floats per buffer.
    pub floats: usize,
    /// Parameter + gradient bytes applied per second, GB/s.
    pub gbps: f64,
    /// memcpy of the same bytes (parameters and gradients copied), GB/s.
    pub memcpy_gbps: f64,
    /// `gbps` over `memcpy_gbps`.
    pub ratio: f64,
}

/// Measures each optimizer on buffers of `floats` floats, `reps` applications each.
pub fn run(floats: usize, reps: usize) -> Vec<Row> {
    // Every kind, and the settings that add a buffer or a branch.
    let specs: Vec<(&str, OptimizerSpec)> = [
        ("sgd", "sgd:0.001"),
        ("momentum", "momentum:0.001:0.9"),
        (
            "sgd nesterov+wd",
            "sgd:0.001,momentum=0.9,nesterov=true,weight_decay=0.0001",
        ),
        ("adam", "adam:0.001"),
        ("adamw", "adamw:0.001"),
        ("adam amsgrad", "adam:0.001,amsgrad=true"),
        ("adagrad", "adagrad:0.01"),
        ("rmsprop", "rmsprop:0.01"),
        (
            "rmsprop centered+momentum",
            "rmsprop:0.01,centered=true,momentum=0.9",
        ),
        ("adadelta", "adadelta:1"),
    ]
    .into_iter()
    .map(|(name, text)| (name, text.parse().expect("a valid optimizer")))
    .collect();
    let bytes = (2 * floats * 4 * reps) as f64;
    let memcpy = memcpy_gbps(floats, reps);
    specs
        .iter()
        .map(|(name, spec)| {
            let mut params = vec![0.5f32; floats];
            let grads = vec![1e-3f32; floats];
            let mut state = OptState::new(spec, floats);
            // One untimed pass faults the pages in.
            state.apply(spec, &mut params, &grads, 1.0);
            let t = Instant::now();
            for _ in 0..reps {
                state.apply(spec, &mut params, &grads, 1.0);
            }
            let g = gbps(bytes, t.elapsed());
            std::hint::black_box(&params);
            Row {
                optimizer: (*name).into(),
                floats,
                gbps: g,
                memcpy_gbps: memcpy,
                ratio: g / memcpy.max(1e-12),
            }
        })
        .collect()
}

/// Copies parameters and gradients (`2 × floats` floats) `reps` times; GB/s of bytes copied.
fn memcpy_gbps(floats: usize, reps: usize) -> f64 {
    let src = vec![1.0f32; 2 * floats];
    let mut dst = vec![0.0f32; 2 * floats];
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    gbps((2 * floats * 4 * reps) as f64, t.elapsed())
}
