//! What the services tell about themselves, apart from the broker transport: logs on stderr
//! filtered by `RUST_LOG`, and distributed traces ([`trace`], exported as [`otlp`] says).
//! Metrics are `agent-metrics`.

mod grpc;
pub mod otlp;
pub mod trace;

pub use trace::flush_spans;

/// The filter when `RUST_LOG` is unset: our info, without the crate's retry chatter.
pub const SERVICE_LOG_FILTER: &str = "info,pulsar::retry_op=error";

/// Logs to stderr (stdout is for a command's output), filtered by `RUST_LOG` or `default_filter`.
/// Logging as [`init_logging`], and when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, our spans exported there over OTLP as
/// `service` unless `OTEL_SERVICE_NAME` names it (see [`crate::otlp`] for every variable read).
/// Must run inside the tokio runtime.
pub fn init_telemetry(default_filter: &str, service: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let export = crate::otlp::settings_from(|name| std::env::var(name).ok(), service);
    let (settings, said) = match export {
        crate::otlp::Export::To(settings, problems) => (Some(settings), Ok(problems)),
        crate::otlp::Export::Refused(why) => (None, Err(why)),
        crate::otlp::Export::Off => (None, Ok(Vec::new())),
    };
    let exporting = settings
        .as_ref()
        .map(|s| (s.shown_url(), s.protocol, s.gzip));
    let spans = settings.map(|settings| {
        let (layer, exporter) = crate::trace::otlp_layer(settings);
        tokio::spawn(exporter);
        // Our own spans only, whatever the log level: a quiet log still gives whole traces.
        layer.with_filter(tracing_subscriber::filter::filter_fn(|meta| {
            meta.is_span()
                && meta.level() <= &tracing::Level::INFO
                && meta.target().starts_with("agent_")
        }))
    });
    tracing_subscriber::registry().with(logs).with(spans).init();
    // Said once the log is there to take it.
    match said {
        Ok(problems) => {
            for problem in problems {
                tracing::warn!("{problem}");
            }
        }
        Err(why) => tracing::error!("{why}"),
    }
    if let Some((url, protocol, gzip)) = exporting {
        tracing::info!(%url, ?protocol, gzip, "exporting spans over OTLP");
    }
}

pub fn init_logging(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .init();
}
