//! Shutdown plumbing: a cancellation token cancelled by SIGINT or SIGTERM.

pub use tokio_util::sync::CancellationToken;

/// Returns a token that is cancelled on the first SIGINT or SIGTERM. A second signal exits the
/// process at once with status 130, for when a clean shutdown hangs.
pub fn on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
        tracing::info!("signal received: shutting down (send again to exit at once)");
        t.cancel();
        tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
        std::process::exit(130);
    });
    token
}
