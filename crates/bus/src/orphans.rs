//! Children that outlive the process that started them: brokers, SPARQL servers and services
//! started for a run (a test, `agentctl up`) are stopped when their owner drops them, but an
//! owner that aborts (a stack overflow, SIGKILL) leaves them running, each a JVM or a broker that
//! loads the machine for every run after it. Each child is marked with its owner; the next owner
//! to start a child stops those whose owner is gone.

use std::process::Command;
use std::time::Duration;

/// The variable that names a child's owner: `<pid>:<start time>` of the process that started it
/// (the start time so that a pid used again by another process is not taken for the owner).
/// Inherited by whatever the child starts in turn.
pub const OWNER_VAR: &str = "PULSAR_AGENTS_CHILD_OWNER";

/// Marks `command` as a child of this process and, the first time in this process, stops the
/// children of owners that are gone.
pub fn owned(command: &mut Command) -> &mut Command {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(stop_orphans);
    match owner_of("self") {
        Some(owner) => command.env(OWNER_VAR, owner),
        None => command,
    }
}

/// The fields of `/proc/{pid}/stat` after the command name (which is in parentheses and may hold
/// spaces), from the state (field 3) on. `None` where there is no such process, or no `/proc`.
pub(crate) fn stat_fields(pid: &str) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.get(stat.rfind(')')? + 1..)?;
    Some(after.split_whitespace().map(str::to_owned).collect())
}

/// `<pid>:<start time in clock ticks since boot>` of the process `pid` (or `self`) while it runs;
/// `None` once it is gone, a zombie included (killed, not yet reaped: its children are orphans).
fn owner_of(pid: &str) -> Option<String> {
    let fields = stat_fields(pid)?;
    // Field 3, the state, and field 22, the start time.
    let (state, started) = (fields.first()?, fields.get(19)?);
    if state == "Z" || state == "X" {
        return None;
    }
    let pid = match pid {
        "self" => std::process::id().to_string(),
        pid => pid.to_owned(),
    };
    Some(format!("{pid}:{started}"))
}

/// The owner a process was marked with, if any.
fn marked_owner(pid: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let marker = format!("{OWNER_VAR}=");
    environ
        .split(|&b| b == 0)
        .filter_map(|var| std::str::from_utf8(var).ok())
        .find_map(|var| var.strip_prefix(marker.as_str()).map(str::to_owned))
}

/// SIGKILLs every process marked with an owner that no longer runs, then again for the children
/// of those (an `agentctl up` owns its broker), a few rounds at most. Root can read every
/// process here, and each is checked the same way: only a process whose owner is gone is
/// touched, and only in this process's pid namespace (a pid in a marker means nothing in another).
fn stop_orphans() {
    for _ in 0..4 {
        if stop_orphans_once() == 0 {
            return;
        }
        // A SIGKILLed owner is a zombie for a moment, then gone; either way its children are
        // orphans in the next round.
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One round of [`stop_orphans`]: how many it stopped.
fn stop_orphans_once() -> usize {
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let namespace = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let ours = namespace("self");
    let mut stopped = 0;
    for process in processes.flatten() {
        let name = process.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Some(owner) = marked_owner(pid) else {
            continue;
        };
        let Some(owner_pid) = owner.split(':').next() else {
            continue;
        };
        if owner_of(owner_pid).as_deref() == Some(owner.as_str()) || namespace(pid) != ours {
            continue;
        }
        // Read again just before the kill, so that a pid freed and used again meanwhile is not
        // killed for the process that had it.
        if marked_owner(pid).as_deref() != Some(owner.as_str()) {
            continue;
        }
        match Command::new("kill").args(["-KILL", pid]).status() {
            Ok(status) if status.success() => {
                tracing::warn!(pid, owner, "stopped a child whose owner is gone");
                stopped += 1;
            }
            Ok(status) => {
                tracing::warn!(pid, owner, %status, "could not stop a child whose owner is gone")
            }
            Err(e) => {
                tracing::warn!(pid, owner, error = %e, "could not stop a child whose owner is gone")
            }
        }
    }
    stopped
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// A child marked with an owner that is gone is stopped by a sweep; one marked with this
    /// process is not. (The sweep is the machine's: it also stops any other orphan it finds.)
    #[test]
    fn a_child_whose_owner_is_gone_is_stopped() {
        // No process has this pid (Linux's pids stop at 2^22).
        let gone = "4294967295:0";
        let mut orphan = Command::new("sleep")
            .arg("30")
            .env(OWNER_VAR, gone)
            .spawn()
            .unwrap();
        let mut kept = owned(&mut Command::new("sleep")).arg("30").spawn().unwrap();
        stop_orphans();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while orphan.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "the orphan still runs"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            kept.try_wait().unwrap().is_none(),
            "a child of a live owner was stopped"
        );
        let _ = kept.kill();
        let _ = kept.wait();
    }
}
