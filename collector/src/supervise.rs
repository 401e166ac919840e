//! The collector's long-lived tasks and what happens when one of them ends.
//!
//! Every one of them is essential: without the bus reader the figures go stale, without
//! the HTTP server nobody sees them, without the flusher the recording stops, without the
//! OTLP export the backend stops hearing. A process that keeps running after losing one
//! looks healthy to its supervisor while serving stale or no figures, so the first task to
//! end, for whatever reason (error, panic, or a return that should never happen), decides:
//! the others are stopped and the process exits with an error naming that task, for the
//! supervisor to restart it.

use futures::future::BoxFuture;
use futures::FutureExt as _;
use std::future::Future;
use tokio::task::{AbortHandle, JoinError, JoinHandle};

/// How an essential task ended.
type Ending = Result<anyhow::Result<()>, JoinError>;

/// One task the process cannot do without.
pub struct Essential<'a> {
    name: &'static str,
    ended: BoxFuture<'a, Ending>,
    /// Stops the task when another one decided; `None` for tasks owned elsewhere.
    abort: Option<AbortHandle>,
}

impl<'a> Essential<'a> {
    /// A spawned task; stopped when another task ends first or on shutdown.
    pub fn task(name: &'static str, task: JoinHandle<anyhow::Result<()>>) -> Self {
        Self {
            name,
            abort: Some(task.abort_handle()),
            ended: task.boxed(),
        }
    }

    /// A future resolving when tasks owned elsewhere end (e.g. the OTLP export's, whose
    /// owner stops them itself).
    pub(crate) fn owned_elsewhere(
        name: &'static str,
        ended: impl Future<Output = Result<(), JoinError>> + Send + 'a,
    ) -> Self {
        Self {
            name,
            ended: ended.map(|r| r.map(Ok)).boxed(),
            abort: None,
        }
    }
}

/// Run until `shutdown` resolves (`Ok`) or the first essential task ends (an error naming
/// it). Either way the spawned tasks still running are aborted and awaited before this
/// returns, so none of them applies a record or answers a request during the cleanup.
pub async fn until_shutdown_or_first_end(
    tasks: Vec<Essential<'_>>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let aborts: Vec<_> = tasks.iter().filter_map(|t| t.abort.clone()).collect();
    let (names, ended): (Vec<_>, Vec<_>) = tasks.into_iter().map(|t| (t.name, t.ended)).unzip();
    let first_end = async {
        if ended.is_empty() {
            // select_all panics on an empty list; with no task, only shutdown can decide.
            std::future::pending::<()>().await;
        }
        let (ending, i, rest) = futures::future::select_all(ended).await;
        (names[i], ending, rest)
    };
    let (result, rest) = tokio::select! {
        (name, ending, rest) = first_end => (Err(describe(name, ending)), rest),
        () = shutdown => (Ok(()), Vec::new()),
    };
    drop(rest);
    for a in &aborts {
        a.abort();
    }
    // An abort takes effect at the task's next await; wait until they are gone, not just
    // told to go.
    while aborts.iter().any(|a| !a.is_finished()) {
        tokio::task::yield_now().await;
    }
    result
}

fn describe(name: &str, ending: Ending) -> anyhow::Error {
    match ending {
        Ok(Ok(())) => anyhow::anyhow!("the {name} stopped, which it never should"),
        Ok(Err(e)) => e.context(format!("the {name} failed")),
        Err(e) if e.is_panic() => {
            let payload = e.into_panic();
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            anyhow::anyhow!("the {name} panicked: {message}")
        }
        Err(e) => anyhow::anyhow!("the {name} was cancelled: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Sets its flag when dropped: a task holding one has been stopped once it is set.
    struct Stopped(Arc<AtomicBool>);
    impl Drop for Stopped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A task that runs until aborted, and a flag telling whether it was stopped.
    fn runs_for_ever() -> (JoinHandle<anyhow::Result<()>>, Arc<AtomicBool>) {
        let stopped = Arc::new(AtomicBool::new(false));
        let guard = Stopped(stopped.clone());
        let task = tokio::spawn(async move {
            let _guard = guard;
            std::future::pending::<()>().await;
            Ok(())
        });
        (task, stopped)
    }

    async fn first_end_of(
        name: &'static str,
        task: JoinHandle<anyhow::Result<()>>,
    ) -> (anyhow::Result<()>, Arc<AtomicBool>) {
        let (other, other_stopped) = runs_for_ever();
        let result = until_shutdown_or_first_end(
            vec![
                Essential::task("HTTP server", other),
                Essential::task(name, task),
            ],
            std::future::pending(),
        )
        .await;
        (result, other_stopped)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_task_ends_the_run_with_its_name_and_stops_the_others() {
        let reader = tokio::spawn(async {
            tokio::task::yield_now().await;
            panic!("attempt to add with overflow");
        });
        let (result, other_stopped) = first_end_of("bus reader", reader).await;
        let e = result.expect_err("a panicked task must end the run with an error");
        assert_eq!(
            format!("{e:#}"),
            "the bus reader panicked: attempt to add with overflow"
        );
        assert!(
            other_stopped.load(Ordering::SeqCst),
            "the other tasks are stopped before it returns"
        );
    }

    #[tokio::test]
    async fn a_formatted_panic_message_is_kept() {
        let reader = tokio::spawn(async move {
            let seq = 7;
            panic!("bad record at {seq}");
        });
        let (result, _) = first_end_of("bus reader", reader).await;
        assert_eq!(
            format!("{:#}", result.unwrap_err()),
            "the bus reader panicked: bad record at 7"
        );
    }

    #[tokio::test]
    async fn a_failing_task_ends_the_run_with_its_error() {
        let reader =
            tokio::spawn(async { Err(anyhow::anyhow!("the durable consumer's stream ended")) });
        let (result, other_stopped) = first_end_of("bus reader", reader).await;
        assert_eq!(
            format!("{:#}", result.unwrap_err()),
            "the bus reader failed: the durable consumer's stream ended"
        );
        assert!(other_stopped.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_task_that_returns_is_an_error_too() {
        let flusher = tokio::spawn(async { Ok(()) });
        let (result, _) = first_end_of("recording flusher", flusher).await;
        assert_eq!(
            format!("{:#}", result.unwrap_err()),
            "the recording flusher stopped, which it never should"
        );
    }

    #[tokio::test]
    async fn a_task_owned_elsewhere_ends_the_run_when_it_panics() {
        let export = tokio::spawn(async { panic!("export loop") });
        let (http, http_stopped) = runs_for_ever();
        let result = until_shutdown_or_first_end(
            vec![
                Essential::task("HTTP server", http),
                Essential::owned_elsewhere("OTLP export", export),
            ],
            std::future::pending(),
        )
        .await;
        assert_eq!(
            format!("{:#}", result.unwrap_err()),
            "the OTLP export panicked: export loop"
        );
        assert!(http_stopped.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn shutdown_ends_the_run_cleanly_and_stops_every_task() {
        let (reader, reader_stopped) = runs_for_ever();
        let (http, http_stopped) = runs_for_ever();
        let result = until_shutdown_or_first_end(
            vec![
                Essential::task("bus reader", reader),
                Essential::task("HTTP server", http),
            ],
            async {},
        )
        .await;
        assert!(result.is_ok(), "{result:?}");
        assert!(reader_stopped.load(Ordering::SeqCst));
        assert!(http_stopped.load(Ordering::SeqCst));
    }
}
