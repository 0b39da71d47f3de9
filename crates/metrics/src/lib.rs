//! Process-wide Prometheus metrics: labelled counters, gauges and histograms kept in one registry and
//! rendered in the text exposition format for `/metrics`.
//!
//! One global registry, because what is measured happens deep in message handling (an LLM call, a
//! tool run) and threading a handle through every layer would buy nothing: a process is one
//! service. Families are declared up front with their help text and kind; recording into an
//! undeclared family is ignored rather than failing a message.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

/// What a family measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// Seconds, in [`LATENCY_BUCKETS`].
    Histogram,
}

/// Upper bounds (seconds) of the latency histograms: from a cached tool call to a slow model.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Number(f64),
    Histogram {
        counts: [u64; LATENCY_BUCKETS.len()],
        count: u64,
        sum: f64,
    },
}

type Labels = Vec<(&'static str, String)>;

struct Family {
    help: &'static str,
    kind: Kind,
    series: BTreeMap<Labels, Value>,
}

/// A set of metric families.
#[derive(Default)]
pub struct Registry {
    families: Mutex<BTreeMap<&'static str, Family>>,
}

static GLOBAL: LazyLock<Registry> = LazyLock::new(Registry::default);

/// The process's registry.
pub fn global() -> &'static Registry {
    &GLOBAL
}

fn labels(pairs: &[(&'static str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect()
}

/// A label value as Prometheus wants it quoted.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn render_labels(labels: &Labels, extra: Option<(&str, String)>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

impl Registry {
    /// Declares a family; declaring it again changes nothing.
    pub fn describe(&self, name: &'static str, kind: Kind, help: &'static str) {
        let mut families = self.families.lock().unwrap_or_else(|p| p.into_inner());
        families.entry(name).or_insert_with(|| Family {
            help,
            kind,
            series: BTreeMap::new(),
        });
    }

    fn update(
        &self,
        name: &str,
        kind: Kind,
        pairs: &[(&'static str, &str)],
        change: impl FnOnce(&mut Value),
    ) {
        let mut families = self.families.lock().unwrap_or_else(|p| p.into_inner());
        let Some(family) = families.get_mut(name) else {
            return;
        };
        if family.kind != kind {
            return;
        }
        let fresh = match kind {
            Kind::Histogram => Value::Histogram {
                counts: [0; LATENCY_BUCKETS.len()],
                count: 0,
                sum: 0.0,
            },
            Kind::Counter | Kind::Gauge => Value::Number(0.0),
        };
        change(family.series.entry(labels(pairs)).or_insert(fresh));
    }

    /// Adds `by` to a counter.
    pub fn add(&self, name: &str, pairs: &[(&'static str, &str)], by: f64) {
        self.update(name, Kind::Counter, pairs, |value| {
            if let Value::Number(n) = value {
                *n += by.max(0.0);
            }
        });
    }

    /// Adds one to a counter.
    pub fn inc(&self, name: &str, pairs: &[(&'static str, &str)]) {
        self.add(name, pairs, 1.0);
    }

    /// Sets a counter kept elsewhere (a component's own atomic count) to its current total.
    pub fn set_total(&self, name: &str, pairs: &[(&'static str, &str)], total: f64) {
        self.update(name, Kind::Counter, pairs, |value| {
            if let Value::Number(n) = value {
                *n = total;
            }
        });
    }

    /// Sets a gauge.
    pub fn set(&self, name: &str, pairs: &[(&'static str, &str)], to: f64) {
        self.update(name, Kind::Gauge, pairs, |value| {
            if let Value::Number(n) = value {
                *n = to;
            }
        });
    }

    /// Records one duration in a histogram.
    pub fn observe(&self, name: &str, pairs: &[(&'static str, &str)], took: Duration) {
        let seconds = took.as_secs_f64();
        self.update(name, Kind::Histogram, pairs, |value| {
            if let Value::Histogram { counts, count, sum } = value {
                for (bound, n) in LATENCY_BUCKETS.iter().zip(counts.iter_mut()) {
                    if seconds <= *bound {
                        *n += 1;
                    }
                }
                *count += 1;
                *sum += seconds;
            }
        });
    }

    /// Every family in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        let families = self.families.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::new();
        for (name, family) in families.iter() {
            let kind = match family.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            let _ = writeln!(out, "# HELP {name} {}", family.help);
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in &family.series {
                match value {
                    Value::Number(n) => {
                        let _ = writeln!(out, "{name}{} {n}", render_labels(labels, None));
                    }
                    Value::Histogram { counts, count, sum } => {
                        for (bound, n) in LATENCY_BUCKETS.iter().zip(counts) {
                            let le = Some(("le", bound.to_string()));
                            let _ = writeln!(out, "{name}_bucket{} {n}", render_labels(labels, le));
                        }
                        let inf = Some(("le", "+Inf".to_owned()));
                        let _ =
                            writeln!(out, "{name}_bucket{} {count}", render_labels(labels, inf));
                        let _ = writeln!(out, "{name}_sum{} {sum}", render_labels(labels, None));
                        let _ =
                            writeln!(out, "{name}_count{} {count}", render_labels(labels, None));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_gauges_and_histograms_render_as_prometheus_text() {
        let registry = Registry::default();
        registry.describe("calls_total", Kind::Counter, "Calls.");
        registry.describe("open", Kind::Gauge, "Open things.");
        registry.describe("latency_seconds", Kind::Histogram, "Latency.");
        registry.inc("calls_total", &[("tool", "a\"b")]);
        registry.add("calls_total", &[("tool", "a\"b")], 2.0);
        registry.set("open", &[], 3.0);
        registry.observe(
            "latency_seconds",
            &[("model", "m")],
            Duration::from_millis(40),
        );
        registry.observe(
            "latency_seconds",
            &[("model", "m")],
            Duration::from_secs(60),
        );
        registry.inc("undeclared_total", &[]);
        registry.set("calls_total", &[("tool", "x")], 9.0);
        let text = registry.render();
        assert!(
            text.contains("# TYPE calls_total counter\ncalls_total{tool=\"a\\\"b\"} 3\n"),
            "{text}"
        );
        assert!(!text.contains("tool=\"x\""), "{text}");
        assert!(text.contains("open 3\n"), "{text}");
        assert!(
            text.contains("latency_seconds_bucket{model=\"m\",le=\"0.025\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("latency_seconds_bucket{model=\"m\",le=\"0.05\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("latency_seconds_bucket{model=\"m\",le=\"+Inf\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("latency_seconds_count{model=\"m\"} 2\n"),
            "{text}"
        );
        assert!(!text.contains("undeclared"), "{text}");
    }
}
