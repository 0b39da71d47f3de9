//! Streaming an LLM call to the client while it is written: ReACT's thought and answer (parsed
//! as they come), or a plain answer. Chunks are a view of work in progress; what is durable goes
//! through [`crate::emit`] at commit.

use agent_bus::BusError;
use agent_core::provenance::SessionUris;
use agent_core::react::{ReactDelta, ReactStream};
use agent_llm::{CallOptions, ChatMessage, Completion, LlmClient, LlmError};
use agent_schema::MessageType;
use tokio::sync::mpsc;

use crate::emit::DialogOutput;

/// Streams the LLM's answer, passing thought and answer text to the client as soon as it is certain.
/// The last thought chunk is held back so it can carry `end_of_message`. A stream that breaks off
/// before any answer text went out becomes a cut-off completion of what arrived (the client saw a
/// thought end early, and the next iteration says why); once answer text went out, the break is an
/// error, since the client cannot be told to forget part of an answer. So is an answer the model
/// ended at its length limit once part of it went out.
pub async fn react_turn(
    llm: &LlmClient,
    messages: &[ChatMessage],
    options: &CallOptions,
    out: &DialogOutput<'_>,
    uris: &SessionUris,
    n: usize,
    last_observation: &str,
) -> Result<Result<Completion, LlmError>, BusError> {
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let call = llm.stream_with(messages, options, tx);
    tokio::pin!(call);
    let mut parser = ReactStream::after_observation(last_observation);
    let mut held_thought: Option<String> = None;
    let thought_id = uris.thought(n);
    let answer_id = uris.conclusion();
    let mut result = None;
    let mut received = String::new();
    let mut answer_started = false;
    // Publish while the LLM is still writing: deltas flow through a bounded channel.
    loop {
        tokio::select! {
            r = &mut call, if result.is_none() => result = Some(r),
            delta = rx.recv() => match delta {
                Some(text) => {
                    received.push_str(&text);
                    for d in parser.push(&text) {
                        answer_started |= matches!(d, ReactDelta::Answer(_));
                        publish_delta(out, d, &mut held_thought, &thought_id, &answer_id).await?;
                    }
                }
                None => break,
            },
        }
    }
    let result = match result {
        Some(r) => r,
        None => call.await,
    };
    let result = match result {
        Err(LlmError::Truncated(why)) if !answer_started => {
            tracing::warn!(%why, "the LLM's stream broke off in the thought; keeping it as a cut-off answer");
            Ok(Completion {
                // The stream broke before its usage: both sides are estimated.
                in_token: agent_llm::estimated_prompt_tokens(messages, options),
                out_token: (received.len() as u64).div_ceil(4),
                text: received,
                model: llm.model().to_owned(),
                cut_off: true,
                ..Completion::default()
            })
        }
        // The model stopped at its length limit in the middle of its answer, part of which the
        // client holds: another iteration would stream a second answer after the first's start,
        // and a client joining the chunks would show both glued together.
        Ok(completion) if completion.cut_off && answer_started => Err(LlmError::Truncated(
            "the model reached its length limit in the middle of its final answer, after part of it was streamed".to_owned(),
        )),
        other => other,
    };
    if matches!(&result, Ok(c) if !c.cut_off) {
        for d in parser.finish() {
            publish_delta(out, d, &mut held_thought, &thought_id, &answer_id).await?;
        }
    }
    if let Some(last) = held_thought.take() {
        out.chunk(MessageType::Thought, &last, &thought_id, true)
            .await?;
    }
    Ok(result)
}

async fn publish_delta(
    out: &DialogOutput<'_>,
    delta: ReactDelta,
    held_thought: &mut Option<String>,
    thought_id: &str,
    answer_id: &str,
) -> Result<(), BusError> {
    match delta {
        ReactDelta::Thought(text) => {
            if let Some(previous) = held_thought.replace(text) {
                out.chunk(MessageType::Thought, &previous, thought_id, false)
                    .await?;
            }
        }
        ReactDelta::Answer(text) => {
            if let Some(last) = held_thought.take() {
                out.chunk(MessageType::Thought, &last, thought_id, true)
                    .await?;
            }
            out.chunk(MessageType::Answer, &text, answer_id, false)
                .await?;
        }
    }
    Ok(())
}

/// Streams the synthesis to the client as answer chunks while the LLM writes it.
pub async fn answer(
    llm: &LlmClient,
    out: &DialogOutput<'_>,
    messages: &[ChatMessage],
    answer_id: &str,
) -> Result<Result<Completion, LlmError>, BusError> {
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let call = llm.stream(messages, tx);
    tokio::pin!(call);
    let mut result = None;
    // The answer is recorded without a reasoning model's `<think>` block: it is sent so too.
    let mut skipping = agent_core::react::ThinkSkipping::default();
    loop {
        tokio::select! {
            r = &mut call, if result.is_none() => result = Some(r),
            delta = rx.recv() => match delta {
                Some(text) => {
                    let shown = skipping.push(&text);
                    if !shown.is_empty() {
                        out.chunk(MessageType::Answer, &shown, answer_id, false).await?;
                    }
                }
                None => break,
            },
        }
    }
    let rest = skipping.finish();
    if !rest.is_empty() {
        out.chunk(MessageType::Answer, &rest, answer_id, false)
            .await?;
    }
    Ok(match result {
        Some(r) => r,
        None => call.await,
    })
}

/// [`answer_unless`]'s handling of `text`: sent once the first visible character is not one of
/// `held`, kept back (`waiting`) until that character comes.
async fn pass_or_hold(
    out: &DialogOutput<'_>,
    answer_id: &str,
    held: &[char],
    (passing, waiting): (&mut Option<bool>, &mut String),
    text: &str,
) -> Result<(), BusError> {
    if text.is_empty() {
        return Ok(());
    }
    match passing {
        Some(true) => {
            out.chunk(MessageType::Answer, text, answer_id, false)
                .await?
        }
        Some(false) => {}
        None => {
            waiting.push_str(text);
            if let Some(first) = waiting.trim_start().chars().next() {
                let pass = !held.contains(&first);
                *passing = Some(pass);
                if pass {
                    let text = std::mem::take(waiting);
                    out.chunk(MessageType::Answer, &text, answer_id, false)
                        .await?;
                }
            }
        }
    }
    Ok(())
}

/// Streams an answer that may turn out not to be one: text whose first visible character is one
/// of `held` (the start of a JSON reply or a code fence) is kept back whole for the caller to read;
/// anything else goes to the client as answer chunks while the LLM writes it. Also says whether
/// the text went out.
pub async fn answer_unless(
    llm: &LlmClient,
    out: &DialogOutput<'_>,
    messages: &[ChatMessage],
    answer_id: &str,
    held: &[char],
) -> Result<(Result<Completion, LlmError>, bool), BusError> {
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let call = llm.stream(messages, tx);
    tokio::pin!(call);
    let mut result = None;
    // None while only whitespace has come: the decision waits for the first visible character.
    let mut passing: Option<bool> = None;
    let mut waiting = String::new();
    // Decided on, and sent, without a reasoning model's `<think>` block, as the text is read:
    // a block opening the reply was streamed as the answer, JSON after it included.
    let mut skipping = agent_core::react::ThinkSkipping::default();
    loop {
        tokio::select! {
            r = &mut call, if result.is_none() => result = Some(r),
            delta = rx.recv() => match delta {
                Some(text) => {
                    let text = skipping.push(&text);
                    pass_or_hold(out, answer_id, held, (&mut passing, &mut waiting), &text).await?;
                }
                None => break,
            },
        }
    }
    let rest = skipping.finish();
    pass_or_hold(out, answer_id, held, (&mut passing, &mut waiting), &rest).await?;
    let result = match result {
        Some(r) => r,
        None => call.await,
    };
    Ok((result, passing == Some(true)))
}
