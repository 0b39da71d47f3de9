//! Guards our patch of the `pulsar` crate (patches/): payload frames decode with and without the
//! optional `[MAGIC 0x0e01][CRC32C]` prefix, and a wrong checksum is still rejected when one is sent.
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

#[test]
fn rejects_a_wrong_checksum_when_one_is_sent() {
    let mut frame = framed_message();
    let last = frame.len() - 1;
    frame[last] ^= 0xff;
    assert!(decoded_data(frame).unwrap_err().contains("Checksum"));
}
