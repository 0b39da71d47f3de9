//! Services run inside the test process: each on its own thread and Tokio runtime, as its binary's
//! `main` would run it (`run(settings, shutdown)`), so a test needs no process for a service it
//! never SIGKILLs, and a panic or error in the service shows in the test's output.

use std::future::Future;
use std::sync::Once;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// A service running in this process. Dropping it stops it at once (its tasks are dropped, its
/// connections closed, nothing drained), as a killed process would stop.
pub struct InProcess {
    /// Asked for a graceful stop: the service drains, as on SIGTERM.
    shutdown: CancellationToken,
    /// Sent or dropped: the service's runtime is torn down without draining.
    abort: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// The stack of the thread that polls an in-process service's own future, as a binary's main
/// thread does with the 8 MiB it gets (`ulimit -s`). A spawned thread's default 2 MiB is thin for
/// a debug build's frames: the aggregator's `run` alone takes 290 KB, its main thread ran 1.1 MB
/// deep creating a producer, and a service's thread overflowed 2 MiB once on Apache Pulsar (the
/// crash did not say which of its threads).
const MAIN_STACK_BYTES: usize = 8 << 20;

impl InProcess {
    /// Starts `service` on a thread of its own, with a two-worker runtime like the binaries'.
    pub fn start<F, Fut>(name: &str, service: F) -> InProcess
    where
        F: FnOnce(CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<()>> + 'static,
    {
        log_once();
        let shutdown = CancellationToken::new();
        let (abort, aborted) = oneshot::channel::<()>();
        let token = shutdown.clone();
        let label = name.to_owned();
        let thread = std::thread::Builder::new()
            // Named apart from the workers, so that a crash says which thread it was in.
            .name(format!("{name}-main"))
            .stack_size(MAIN_STACK_BYTES)
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name(label.clone())
                    // As the orchestrator's binary has it (any service may run steps here).
                    .thread_stack_size(agent_orchestrator::WORKER_STACK_BYTES)
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        eprintln!("{label}: no runtime: {e}");
                        return;
                    }
                };
                let outcome = runtime.block_on(async move {
                    tokio::select! {
                        result = service(token) => result,
                        _ = aborted => Ok(()),
                    }
                });
                if let Err(e) = outcome {
                    // What the binary would print on exiting with an error.
                    eprintln!("{label} exited: {e:#}");
                }
                // Waits (briefly) for the workers to drop the tasks, so the service's sockets are
                // closed when `kill` returns, as the kernel closes a killed process's at once.
                runtime.shutdown_timeout(Duration::from_secs(2));
            })
            .unwrap();
        InProcess {
            shutdown,
            abort: Some(abort),
            thread: Some(thread),
        }
    }

    /// Asks for a graceful stop, as SIGTERM does for the binary.
    pub fn terminate(&self) {
        self.shutdown.cancel();
    }

    /// Stops at once, without draining, and waits until the service's runtime is gone.
    pub fn kill(&mut self) {
        if let Some(abort) = self.abort.take() {
            let _ = abort.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The services' logs go to the test's stderr, filtered by `RUST_LOG` (default: warnings), as the
/// child processes' do.
fn log_once() {
    static LOGGING: Once = Once::new();
    LOGGING.call_once(|| {
        let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .try_init();
    });
}
