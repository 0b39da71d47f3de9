//! Guards our patch of the `pulsar` crate (patches/): payload frames decode with and without the
//! optional `[MAGIC 0x0e01][CRC32C]` prefix; a payload whose checksum (when one is sent) does not hold
//! or whose metadata does not decode is not handed over, and the frames after it are read.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::{Buf, BufMut, BytesMut};
use pulsar::message::proto::{base_command, BaseCommand, CommandMessage, MessageIdData};
use pulsar::message::{Codec, Message, Metadata, Payload};
use tokio_util::codec::{Decoder, Encoder};

fn framed_message() -> BytesMut {
    let message = Message {
        command: Box::new(BaseCommand {
            r#type: base_command::Type::Message as i32,
            message: Some(CommandMessage {
                consumer_id: 7,
                message_id: MessageIdData {
                    ledger_id: 1,
                    entry_id: 2,
                    ..MessageIdData::default()
                },
                ..CommandMessage::default()
            }),
            ..BaseCommand::default()
        }),
        payload: Some(Payload {
            metadata: Metadata {
                producer_name: "test".into(),
                ..Metadata::default()
            },
            data: b"{\"question\": \"hi\"}".to_vec(),
        }),
    };
    let mut buf = BytesMut::new();
    Codec.encode(message, &mut buf).unwrap();
    buf
}

/// Removes the magic number and checksum, as pulsar-lite sends frames.
fn without_prefix(framed: &BytesMut) -> BytesMut {
    let mut reader = &framed[..];
    let total = reader.get_u32();
    let command_size = reader.get_u32() as usize;
    let prefix_at = 8 + command_size;
    assert_eq!(&framed[prefix_at..prefix_at + 2], &[0x0e, 0x01]);
    let mut out = BytesMut::new();
    out.put_u32(total - 6);
    out.extend_from_slice(&framed[4..prefix_at]);
    out.extend_from_slice(&framed[prefix_at + 6..]);
    out
}

fn decoded_data(mut frame: BytesMut) -> Result<Vec<u8>, String> {
    let message = Codec
        .decode(&mut frame)
        .map_err(|e| e.to_string())?
        .ok_or("incomplete frame")?;
    Ok(message.payload.ok_or("no payload")?.data)
}

#[test]
fn decodes_frames_with_the_checksum_prefix() {
    assert_eq!(
        decoded_data(framed_message()).unwrap(),
        b"{\"question\": \"hi\"}"
    );
}

#[test]
fn decodes_frames_without_the_checksum_prefix() {
    assert_eq!(
        decoded_data(without_prefix(&framed_message())).unwrap(),
        b"{\"question\": \"hi\"}"
    );
}

/// What the codec reads from `frame` followed by a good frame: the first message's payload (or
/// why it has none), and the second's data, which shows the stream went on past the first.
fn read_before_a_good_frame(frame: BytesMut) -> (Result<Vec<u8>, String>, Vec<u8>) {
    let mut buf = frame;
    buf.extend_from_slice(&framed_message());
    let first = Codec
        .decode(&mut buf)
        .expect("a payload that cannot be read must not fail the connection")
        .expect("a whole frame");
    let second = Codec.decode(&mut buf).unwrap().expect("a whole frame");
    assert!(buf.is_empty());
    (
        first
            .payload
            .map(|p| p.data)
            .ok_or_else(|| "no payload".to_string()),
        second.payload.unwrap().data,
    )
}

/// A wrong checksum (when one is sent) is not handed over: the message comes without its payload,
/// for the consumer to ack and drop, and the frames after it are read.
#[test]
fn a_wrong_checksum_leaves_the_message_without_its_payload() {
    let mut frame = framed_message();
    let last = frame.len() - 1;
    frame[last] ^= 0xff;
    let (first, second) = read_before_a_good_frame(frame);
    assert_eq!(first.unwrap_err(), "no payload");
    assert_eq!(second, b"{\"question\": \"hi\"}");
}

/// Metadata that does not decode (here a producer name that is not UTF-8, which a Go or C++
/// producer can send) leaves the message without its payload, as a wrong checksum does; it failed
/// the codec, which drops the connection with every consumer and producer on it.
#[test]
fn metadata_that_does_not_decode_leaves_the_message_without_its_payload() {
    let mut frame = without_prefix(&framed_message());
    let at = frame.windows(4).position(|w| w == b"test").unwrap();
    frame[at] = 0xff;
    let (first, second) = read_before_a_good_frame(frame);
    assert_eq!(first.unwrap_err(), "no payload");
    assert_eq!(second, b"{\"question\": \"hi\"}");
}
