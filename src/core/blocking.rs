//! CPU work of a request (tokenizing its texts, decoding its audio, computing its features) run
//! off the async threads, and stopped when nobody awaits it any more.

/// Run `work` on tokio's blocking threads, handing it a flag that turns true when the future
/// awaiting it is dropped: its client went away (hyper drops a request's future when its
/// connection closes), and `work` stops at the next point it checks the flag, rather than
/// going on for nobody. An error is a panic in `work`, or a shutdown.
pub async fn until_dropped<T: Send + 'static>(
    work: impl FnOnce(&dyn Fn() -> bool) -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    let gone = tokio_util::sync::CancellationToken::new();
    let flag = gone.clone();
    // Cancels `gone` when this future is dropped, finished or not.
    let _guard = gone.drop_guard();
    tokio::task::spawn_blocking(move || work(&|| flag.is_cancelled())).await
}
