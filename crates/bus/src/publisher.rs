//! A producer handle that many tasks share and that reports success only once the broker has the message.

use std::collections::HashMap;
use std::sync::Arc;

use pulsar::producer::{Message, ProducerOptions, SendFuture};
use pulsar::{Producer, TokioExecutor};
use tokio::sync::Mutex;

use crate::{Bus, BusError, Properties};

/// How long a send may wait to be queued (for the producer, then for room in its queue): the
/// crate's operation timeout, which then bounds the wait for the receipt.
const ENQUEUE_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// Publishes to one topic. Cloning shares the producer.
#[derive(Clone)]
pub struct Publisher {
    topic: String,
    producer: Arc<Mutex<Producer<TokioExecutor>>>,
    max_message_bytes: usize,
}

impl Publisher {
    pub async fn new(bus: &Bus, topic: &str) -> Result<Publisher, BusError> {
        let producer = crate::error::until_settled(topic, || {
            bus.client()
                .producer()
                .with_topic(topic)
                .with_options(ProducerOptions {
                    // Past ~100 pipelined sends the crate answers SlowDown; waiting is what we want.
                    block_queue_if_full: true,
                    compression: Some(bus.compression().for_producer()),
                    ..ProducerOptions::default()
                })
                .build()
        })
        .await
        .map_err(|e| BusError::Producer {
            topic: topic.to_owned(),
            message: e.to_string(),
        })?;
        Ok(Publisher {
            topic: topic.to_owned(),
            producer: Arc::new(Mutex::new(producer)),
            max_message_bytes: bus.max_message_bytes(),
        })
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The largest message this publisher sends (the broker's limit).
    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// What the broker counts against its limit: the payload and the properties.
    pub fn message_bytes(payload: &[u8], properties: &Properties) -> usize {
        payload.len()
            + properties
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }

    /// Sends and waits for the broker's receipt: only then may the input that caused it be acked.
    pub async fn send(&self, payload: Vec<u8>, properties: &Properties) -> Result<(), BusError> {
        self.enqueue(payload, properties).await?.wait().await
    }

    /// Hands the message to the producer and returns its receipt without waiting for it, so one
    /// iteration's messages travel pipelined. Messages enqueued in order reach the broker in order.
    pub async fn enqueue(
        &self,
        payload: Vec<u8>,
        properties: &Properties,
    ) -> Result<Receipt, BusError> {
        let bytes = Self::message_bytes(&payload, properties);
        if bytes > self.max_message_bytes {
            return Err(BusError::TooLarge {
                topic: self.topic.clone(),
                bytes,
                max: self.max_message_bytes,
                limit: crate::BROKER_MESSAGE_LIMIT.to_owned(),
            });
        }
        let message = Message {
            payload,
            properties: properties
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<HashMap<_, _>>(),
            ..Message::default()
        };
        // The lock is held only to enqueue, so sends from many tasks pipeline; enqueue order under
        // the lock is the order the broker sees.
        let enqueued = async {
            let mut producer = self.producer.lock().await;
            producer
                .send_non_blocking(message)
                .await
                .map_err(|e| publish_error(&self.topic, e))
        };
        // With the producer's queue full (a broker that stopped reading: frozen, or its host gone
        // without a reset), the crate waits for room without a deadline, holding our lock, and
        // every task publishing here queued behind it for as long as the connection stayed open.
        // Given up, the message was not queued (the crate's queue takes it whole or not at all).
        let future = tokio::time::timeout(ENQUEUE_WITHIN, enqueued)
            .await
            .map_err(|_| BusError::Publish {
                topic: self.topic.clone(),
                message: format!(
                    "the broker took no message for {} s (its queue stayed full)",
                    ENQUEUE_WITHIN.as_secs()
                ),
            })??;
        Ok(Receipt {
            topic: self.topic.clone(),
            future,
        })
    }
}

fn publish_error(topic: &str, e: pulsar::Error) -> BusError {
    BusError::Publish {
        topic: topic.to_owned(),
        message: e.to_string(),
    }
}

/// The broker's pending confirmation of one message.
pub struct Receipt {
    topic: String,
    future: SendFuture,
}

impl Receipt {
    /// Resolves once the broker has the message.
    pub async fn wait(self) -> Result<(), BusError> {
        self.future
            .await
            .map(|_| ())
            .map_err(|e| publish_error(&self.topic, e))
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use pulsar::consumer::{ConsumerOptions, InitialPosition};
    use pulsar::message::proto::CompressionType;
    use pulsar::{Consumer, SubType, TokioExecutor};

    use crate::embedded::EmbeddedBroker;
    use crate::{Bus, Compression, Properties, Publisher};

    /// What a consumer of `topic` is handed for one message: its payload and the compression its
    /// metadata names.
    async fn sent_as(bus: &Bus, topic: &str, payload: &[u8]) -> (Vec<u8>, Option<i32>) {
        let mut consumer: Consumer<Vec<u8>, TokioExecutor> = bus
            .client()
            .consumer()
            .with_topic(topic)
            .with_subscription("compression-test")
            .with_subscription_type(SubType::Exclusive)
            .with_options(ConsumerOptions {
                initial_position: InitialPosition::Earliest,
                ..ConsumerOptions::default()
            })
            .build()
            .await
            .unwrap();
        let publisher = Publisher::new(bus, topic).await.unwrap();
        publisher
            .send(payload.to_vec(), &Properties::new())
            .await
            .unwrap();
        let message = tokio::time::timeout(std::time::Duration::from_secs(10), consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        consumer.ack(&message).await.unwrap();
        (message.payload.data, message.payload.metadata.compression)
    }

    /// A message that decompresses to more than the largest message taken (5 MiB: a compression
    /// bomb, 6 MiB of zeros in a few hundred bytes) is dropped where it is read, and what follows
    /// is read; without our patch's bound the reader was handed it whole, whatever its size.
    #[tokio::test]
    async fn a_message_decompressing_past_the_bound_is_dropped_and_the_next_read() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        for topic in [
            "persistent://public/default/bomb-test",
            "non-persistent://public/default/bomb-test",
        ] {
            let mut listener = crate::Listener::subscribe(&bus, topic, "bomb")
                .await
                .unwrap();
            for compression in [Compression::Zstd, Compression::Lz4] {
                // The crate's own producer: ours refuses a payload over the bound before sending.
                let mut bomb = bus
                    .client()
                    .producer()
                    .with_topic(topic)
                    .with_options(pulsar::producer::ProducerOptions {
                        compression: Some(compression.for_producer()),
                        ..pulsar::producer::ProducerOptions::default()
                    })
                    .build()
                    .await
                    .unwrap();
                bomb.send_non_blocking(vec![0u8; 6 * 1024 * 1024])
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                let after = format!("after {compression:?}");
                Publisher::new(&bus, topic)
                    .await
                    .unwrap()
                    .send(after.clone().into_bytes(), &Properties::new())
                    .await
                    .unwrap();
                let read = tokio::time::timeout(
                    std::time::Duration::from_secs(10),
                    listener.next_payload(),
                )
                .await
                .unwrap()
                .unwrap();
                assert_eq!(read.len(), after.len(), "{topic} {compression:?}");
                assert_eq!(read, after.as_bytes());
            }
        }
    }

    /// A batch whose members would copy more of its envelope's metadata than four times the
    /// largest message taken (here 400 members, each to get a 64 KiB producer name: 26 MB from a
    /// frame of 64 KiB) is dropped where it is read, and what follows is read; without our
    /// patch's bound a frame of a few megabytes came apart into gigabytes.
    #[tokio::test]
    async fn a_batch_that_would_copy_its_metadata_past_the_bound_is_dropped() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topic = "persistent://public/default/batch-copies-test";
        let mut listener = crate::Listener::subscribe(&bus, topic, "batch")
            .await
            .unwrap();
        let mut batcher = bus
            .client()
            .producer()
            .with_topic(topic)
            .with_name("p".repeat(64 * 1024))
            .with_options(pulsar::producer::ProducerOptions {
                batch_size: Some(400),
                ..pulsar::producer::ProducerOptions::default()
            })
            .build()
            .await
            .unwrap();
        let mut receipts = Vec::new();
        for _ in 0..400 {
            receipts.push(batcher.send_non_blocking(b"m".to_vec()).await.unwrap());
        }
        for receipt in receipts {
            receipt.await.unwrap();
        }
        Publisher::new(&bus, topic)
            .await
            .unwrap()
            .send(b"after".to_vec(), &Properties::new())
            .await
            .unwrap();
        let read =
            tokio::time::timeout(std::time::Duration::from_secs(10), listener.next_payload())
                .await
                .unwrap()
                .unwrap();
        assert_eq!(read, b"after");
    }

    /// Publishers send payloads as they are unless the bus says otherwise, and what is read is
    /// what was sent.
    #[tokio::test]
    async fn publishers_compress_as_the_bus_says() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let payload = br#"{"s": {"t": "i", "i": "urn:trustgraph:agent:s/i1"}}"#.repeat(100);
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let (read, compression) =
            sent_as(&bus, "persistent://public/default/plain-test", &payload).await;
        assert_eq!(read, payload);
        assert_eq!(compression, None);
        for (setting, expected, topic) in [
            (
                Compression::Lz4,
                CompressionType::Lz4,
                "persistent://public/default/lz4-test",
            ),
            (
                Compression::Zstd,
                CompressionType::Zstd,
                "non-persistent://public/default/zstd-test",
            ),
        ] {
            let bus = Bus::connect(&broker.url(), None)
                .await
                .unwrap()
                .with_compression(setting);
            let (read, compression) = sent_as(&bus, topic, &payload).await;
            assert_eq!(read, payload, "{setting:?}");
            assert_eq!(compression, Some(expected as i32), "{setting:?}");
        }
    }
}
