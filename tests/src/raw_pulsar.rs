//! A producer that speaks Pulsar's binary protocol by hand, to publish what no client library we
//! link can: a message whose metadata holds a property that is not UTF-8, as a Go or C++ producer
//! may send (their strings are bytes) and as Apache Pulsar stores and delivers without a check.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context};
use bytes::{Buf, BufMut, BytesMut};
use futures::{SinkExt, StreamExt};
use pulsar::message::proto::{
    base_command, BaseCommand, CommandConnect, CommandProducer, CommandSend, KeyValue,
};
use pulsar::message::{Codec, Message, Metadata, Payload};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::codec::{Encoder, Framed};

/// Stands in for the property's value while the frame is encoded (the encoder takes only UTF-8),
/// then its first byte becomes 0xff, which is never UTF-8.
const PLACEHOLDER: &[u8] = b"~placeholder-for-bytes-that-are-not-utf8~";

/// Publishes `payload` to `topic` with an `id` property and a property whose value is not UTF-8,
/// and waits for the broker's receipt. `broker_url` is `pulsar://host:port`.
pub async fn send_with_unreadable_metadata(
    broker_url: &str,
    topic: &str,
    id: &str,
    payload: &[u8],
) -> anyhow::Result<()> {
    let address = broker_url
        .strip_prefix("pulsar://")
        .ok_or_else(|| anyhow!("not a pulsar:// url: {broker_url}"))?;
    let mut connection = Framed::new(TcpStream::connect(address).await?, Codec);
    connection
        .send(command(base_command::Type::Connect, |c| {
            c.connect = Some(CommandConnect {
                client_version: "agent-e2e-raw".to_owned(),
                protocol_version: Some(21),
                ..CommandConnect::default()
            })
        }))
        .await?;
    answer(&mut connection, |c| c.connected.is_some()).await?;
    // A broker loading the topic may ask to be tried again.
    let mut producer_name = None;
    for request_id in 1..=20u64 {
        connection
            .send(command(base_command::Type::Producer, |c| {
                c.producer = Some(CommandProducer {
                    topic: topic.to_owned(),
                    producer_id: 1,
                    request_id,
                    ..CommandProducer::default()
                })
            }))
            .await?;
        let reply = answer(&mut connection, |c| {
            c.producer_success.is_some() || c.error.is_some()
        })
        .await?;
        if let Some(success) = reply.command.producer_success {
            producer_name = Some(success.producer_name);
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let producer_name = producer_name.context("the broker refused the producer 20 times")?;
    let published = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
    let mut message = command(base_command::Type::Send, |c| {
        c.send = Some(CommandSend {
            producer_id: 1,
            sequence_id: 0,
            num_messages: Some(1),
            ..CommandSend::default()
        })
    });
    message.payload = Some(Payload {
        metadata: Metadata {
            producer_name,
            sequence_id: 0,
            publish_time: published,
            properties: vec![
                KeyValue {
                    key: "id".to_owned(),
                    value: id.to_owned(),
                },
                KeyValue {
                    key: "note".to_owned(),
                    value: String::from_utf8(PLACEHOLDER.to_vec())?,
                },
            ],
            ..Metadata::default()
        },
        data: payload.to_vec(),
    });
    let mut frame = BytesMut::new();
    Codec.encode(message, &mut frame)?;
    let mut frame = without_checksum(frame)?;
    let at = frame
        .windows(PLACEHOLDER.len())
        .position(|w| w == PLACEHOLDER)
        .context("the placeholder is not in the frame")?;
    frame[at] = 0xff;
    connection.get_mut().write_all(&frame).await?;
    answer(&mut connection, |c| c.send_receipt.is_some()).await?;
    Ok(())
}

/// A command of `kind` without a payload, filled in by `fill`.
fn command(kind: base_command::Type, fill: impl FnOnce(&mut BaseCommand)) -> Message {
    let mut command = Box::new(BaseCommand {
        r#type: kind as i32,
        ..BaseCommand::default()
    });
    fill(&mut command);
    Message {
        command,
        payload: None,
    }
}

/// The next command the broker sends that `wanted` accepts (pings and the like passed over), or
/// an error if it sends an error first or nothing in 30 s.
async fn answer(
    connection: &mut Framed<TcpStream, Codec>,
    wanted: impl Fn(&BaseCommand) -> bool,
) -> anyhow::Result<Message> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let next = tokio::time::timeout_at(deadline, connection.next())
            .await
            .context("no answer from the broker in 30 s")?
            .context("the broker closed the connection")??;
        if wanted(&next.command) {
            return Ok(next);
        }
        if let Some(error) = next.command.send_error {
            bail!("the broker refused the message: {error:?}");
        }
    }
}

/// The frame without the optional `[MAGIC 0x0e01][CRC32C]` prefix of its payload, whose checksum
/// the changed byte would break (the protocol allows it; pulsar-lite sends frames so).
fn without_checksum(framed: BytesMut) -> anyhow::Result<BytesMut> {
    let mut reader = &framed[..];
    let total = reader.get_u32();
    let command_size = reader.get_u32() as usize;
    let prefix_at = 8 + command_size;
    if framed.get(prefix_at..prefix_at + 2) != Some(&[0x0e, 0x01][..]) {
        bail!("the encoder sent no checksum prefix");
    }
    let mut out = BytesMut::with_capacity(framed.len());
    out.put_u32(total - 6);
    out.extend_from_slice(&framed[4..prefix_at]);
    out.extend_from_slice(&framed[prefix_at + 6..]);
    Ok(out)
}
