//! Distributed traces: our `tracing` spans exported over OTLP ([`crate::otlp`]) when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, with the W3C `traceparent` carried in a message property so
//! that a dialog's spans in every process (orchestrator iterations, the aggregator's writes and
//! fan-ins) join into one trace.
//!
//! A small exporter of our own rather than the OpenTelemetry SDK: spans are all we export, and the
//! SDK with its OTLP exporter would add a large dependency tree for that.

use std::time::SystemTime;

use tokio::sync::mpsc;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The message property that carries the trace context (W3C Trace Context format).
pub const TRACEPARENT_PROPERTY: &str = "traceparent";
/// A span field of this name starts the span in that remote context.
pub const TRACEPARENT_FIELD: &str = "traceparent";

/// The identity of a span, kept in its extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanIds {
    pub trace_id: u128,
    pub span_id: u64,
}

impl SpanIds {
    pub fn traceparent(&self) -> String {
        format!("00-{:032x}-{:016x}-01", self.trace_id, self.span_id)
    }
}

/// Trace and parent span of a `traceparent` value, if it is one.
pub fn parse_traceparent(value: &str) -> Option<SpanIds> {
    let mut parts = value.trim().split('-');
    let (version, trace, span) = (parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || trace.len() != 32 || span.len() != 16 {
        return None;
    }
    let trace_id = u128::from_str_radix(trace, 16).ok()?;
    let span_id = u64::from_str_radix(span, 16).ok()?;
    (trace_id != 0 && span_id != 0).then_some(SpanIds { trace_id, span_id })
}

/// The `traceparent` naming `span`, when spans are being exported.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    span.with_subscriber(|(id, dispatch)| {
        let registry = dispatch.downcast_ref::<tracing_subscriber::Registry>()?;
        let data = registry.span(id)?;
        let extensions = data.extensions();
        extensions.get::<Open>().map(|open| open.ids.traceparent())
    })
    .flatten()
}

/// A span being recorded.
struct Open {
    ids: SpanIds,
    parent: Option<u64>,
    start: SystemTime,
    attributes: Vec<(String, String)>,
}

/// A finished span, on its way to the collector.
pub(crate) struct Finished {
    pub(crate) name: &'static str,
    pub(crate) ids: SpanIds,
    pub(crate) parent: Option<u64>,
    pub(crate) start: SystemTime,
    pub(crate) end: SystemTime,
    pub(crate) attributes: Vec<(String, String)>,
}

#[derive(Default)]
struct Fields {
    traceparent: Option<String>,
    values: Vec<(String, String)>,
}

/// The longest value a span attribute keeps (then cut on a character, `…` added): span fields
/// carry what a client sent (a session id, a pattern's name), refused requests' too, and one of
/// megabytes took the whole export batch with it when the collector refused its size.
const MOST_ATTRIBUTE_BYTES: usize = 1024;

/// The most attributes a span keeps.
const MOST_ATTRIBUTES: usize = 64;

/// `value`, cut to [`MOST_ATTRIBUTE_BYTES`].
fn bounded(value: &str) -> String {
    if value.len() <= MOST_ATTRIBUTE_BYTES {
        return value.to_owned();
    }
    let mut end = MOST_ATTRIBUTE_BYTES;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &value[..end])
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == TRACEPARENT_FIELD {
            self.traceparent = Some(bounded(value));
        } else if self.values.len() < MOST_ATTRIBUTES {
            self.values.push((field.name().to_owned(), bounded(value)));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

fn nonzero_u64() -> u64 {
    rand::random::<u64>().max(1)
}

/// Collects our spans and hands finished ones to the exporter.
pub struct OtlpLayer {
    finished: mpsc::Sender<Finished>,
    dropped: crate::otlp::Dropped,
}

impl<S> Layer<S> for OtlpLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let local_parent = attrs
            .parent()
            .and_then(|p| ctx.span(p))
            .or_else(|| {
                attrs
                    .is_contextual()
                    .then(|| ctx.lookup_current())
                    .flatten()
            })
            .and_then(|p| p.extensions().get::<Open>().map(|o| o.ids));
        let remote = fields.traceparent.as_deref().and_then(parse_traceparent);
        let (trace_id, parent) = match (remote, local_parent) {
            (Some(remote), _) => (remote.trace_id, Some(remote.span_id)),
            (None, Some(local)) => (local.trace_id, Some(local.span_id)),
            (None, None) => (rand::random::<u128>().max(1), None),
        };
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Open {
                ids: SpanIds {
                    trace_id,
                    span_id: nonzero_u64(),
                },
                parent,
                start: SystemTime::now(),
                attributes: fields.values,
            });
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        values.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            if let Some(open) = span.extensions_mut().get_mut::<Open>() {
                open.attributes.extend(fields.values);
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else {
            return;
        };
        let name = span.name();
        let Some(open) = span.extensions_mut().remove::<Open>() else {
            return;
        };
        // A full queue (the collector is down) loses spans, never blocks an iteration.
        let queued = self.finished.try_send(Finished {
            name,
            ids: open.ids,
            parent: open.parent,
            start: open.start,
            end: SystemTime::now(),
            attributes: open.attributes,
        });
        if queued.is_err() {
            self.dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The layer exporting as `settings` say, and the exporter task it feeds (to be spawned on the
/// runtime).
pub fn otlp_layer(
    settings: crate::otlp::ExportSettings,
) -> (
    OtlpLayer,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = mpsc::channel(8192);
    let dropped = crate::otlp::Dropped::default();
    let (flush, flushes) = mpsc::channel(4);
    // The first exporter only: a process sets its subscriber once.
    let _ = FLUSH.set(flush);
    (
        OtlpLayer {
            finished: tx,
            dropped: dropped.clone(),
        },
        crate::otlp::export(settings, rx, dropped, flushes),
    )
}

/// Where [`flush_spans`] asks the exporter to export at once.
static FLUSH: std::sync::OnceLock<mpsc::Sender<crate::otlp::Flush>> = std::sync::OnceLock::new();

/// Exports the spans finished so far at once and waits (at most `within`) until the collector has
/// them; nothing when spans are not exported. A service calls it as it stops: its last spans
/// (those of its drain, say) waited for the exporter's next tick and were lost with the process.
pub async fn flush_spans(within: std::time::Duration) {
    let Some(flush) = FLUSH.get() else {
        return;
    };
    let (done, exported) = tokio::sync::oneshot::channel();
    let asked = async {
        if flush.send(done).await.is_ok() {
            let _ = exported.await;
        }
    };
    let _ = tokio::time::timeout(within, asked).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_attribute_is_cut_on_a_character() {
        assert_eq!(bounded("short"), "short");
        let long = "é".repeat(MOST_ATTRIBUTE_BYTES);
        let cut = bounded(&long);
        assert!(
            cut.len() <= MOST_ATTRIBUTE_BYTES + '…'.len_utf8(),
            "{}",
            cut.len()
        );
        assert!(cut.ends_with('…'));
        assert!(cut.trim_end_matches('…').chars().all(|c| c == 'é'));
    }

    #[test]
    fn traceparent_round_trips_and_rejects_what_is_not_one() {
        let ids = SpanIds {
            trace_id: 0x4bf92f3577b34da6a3ce929d0e0e4736,
            span_id: 0x00f067aa0ba902b7,
        };
        let header = ids.traceparent();
        assert_eq!(
            header,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(parse_traceparent(&header), Some(ids));
        assert_eq!(parse_traceparent(""), None);
        assert_eq!(parse_traceparent("00-xyz-00f067aa0ba902b7-01"), None);
        assert_eq!(
            parse_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            None
        );
    }
}
