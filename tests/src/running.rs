//! A service of a test wherever it runs (a child process, or a thread of the test process), so
//! the harness stops, watches and waits for both the same way.

use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::in_process::InProcess;
use crate::{binary, Place};

/// The service binary `name`, to be given its arguments and spawned: the test's log filter
/// (default: warnings), and no stdout.
pub(crate) fn command(name: &str) -> Command {
    let mut command = Command::new(binary(name));
    agent_bus::orphans::owned(&mut command)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::null());
    command
}

/// `args` parsed into a service's settings as its binary `name` parses its command line (the
/// flags, then the environment).
pub(crate) fn settings<S: clap::Args + clap::FromArgMatches>(
    name: &str,
    args: impl IntoIterator<Item = OsString>,
) -> S {
    #[derive(clap::Parser)]
    struct Cli<S: clap::Args + clap::FromArgMatches> {
        #[command(flatten)]
        settings: S,
    }
    let line = std::iter::once(OsString::from(name)).chain(args);
    <Cli<S> as clap::Parser>::try_parse_from(line)
        .unwrap()
        .settings
}

pub(crate) enum Running {
    Child(Child),
    InProcess(InProcess),
}

/// Why a service did not come up.
#[derive(Debug)]
pub(crate) enum NotListening {
    /// The child exited first (a port taken, a bad flag).
    Exited(ExitStatus),
    /// The in-process service returned first (its error is in the test's output).
    Returned,
}

impl std::fmt::Display for NotListening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotListening::Exited(status) => write!(f, "exited: {status}"),
            NotListening::Returned => f.write_str("returned (its error is above)"),
        }
    }
}

impl Running {
    pub(crate) fn place(&self) -> Place {
        match self {
            Running::Child(_) => Place::Child,
            Running::InProcess(_) => Place::InProcess,
        }
    }

    /// Asks for a graceful stop (SIGTERM for a child): it then drains and exits by itself.
    pub(crate) fn terminate(&self) {
        match self {
            Running::Child(child) => {
                let _ = Command::new("kill")
                    .arg("-TERM")
                    .arg(child.id().to_string())
                    .status();
            }
            Running::InProcess(service) => service.terminate(),
        }
    }

    /// Stops it at once: SIGKILL for a child (no drain, no goodbye to the broker); in process,
    /// its runtime is torn down with its connections.
    pub(crate) fn kill(&mut self) {
        match self {
            Running::Child(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Running::InProcess(service) => service.kill(),
        }
    }

    pub(crate) fn is_running(&mut self) -> bool {
        match self {
            Running::Child(child) => matches!(child.try_wait(), Ok(None)),
            Running::InProcess(service) => service.is_running(),
        }
    }

    /// The child's exit status once it has exited; `None` while it runs, and always in process
    /// (a test that reads how a service exited runs it as a child).
    pub(crate) fn exit_status(&mut self) -> Option<ExitStatus> {
        match self {
            Running::Child(child) => child.try_wait().ok().flatten(),
            Running::InProcess(_) => None,
        }
    }

    /// The child's process id, to watch its CPU; `None` in process.
    pub(crate) fn pid(&self) -> Option<u32> {
        match self {
            Running::Child(child) => Some(child.id()),
            Running::InProcess(_) => None,
        }
    }

    /// Freezes a child (SIGSTOP) or lets it go on (SIGCONT), as a long pause of the process
    /// would: its connections stay open and its timers run late.
    pub(crate) fn freeze(&self, frozen: bool, what: &str) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("only {what} started as a child can be frozen"));
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// Waits up to 30 s for it to accept connections on `addr`, or to stop first, rather than 30 s
    /// of waiting for nothing.
    pub(crate) fn wait_listening(&mut self, addr: &str, what: &str) -> Result<(), NotListening> {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(addr).is_err() {
            match self {
                Running::Child(child) => {
                    if let Ok(Some(status)) = child.try_wait() {
                        return Err(NotListening::Exited(status));
                    }
                }
                Running::InProcess(service) => {
                    if !service.is_running() {
                        return Err(NotListening::Returned);
                    }
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{what} never listened on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}
