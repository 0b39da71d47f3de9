"""Asks an agent service a question with TrustGraph's own client library (trustgraph-base), exactly
as a TrustGraph service or application does: its Pulsar backend, its request/response client, its
schema dataclasses, TrustGraph's queue names for the workspace and flow. Streams the answer and
prints every response as one JSON line, then a last line {"done": true, "answer": ...}.

The drop-in test (tests/tests/trustgraph.rs) runs it against agent-orchestrator started with no
settings but the broker's and the LLM's addresses."""

import argparse
import asyncio
import dataclasses
import json
import os
import logging
import sys

from trustgraph.base.async_pulsar_backend import AsyncPulsarBackend
from trustgraph.base.request_response_client import RequestResponseClient
from trustgraph.schema import AgentRequest, AgentResponse


async def ask(args):
    backend = AsyncPulsarBackend(host=args.pulsar_host, api_key=args.token)
    client = await RequestResponseClient.create(
        backend=backend,
        request_topic=f"request:tg:agent:{args.workspace}:{args.flow}",
        response_topic=f"response:tg:agent:{args.workspace}:{args.flow}",
        request_schema=AgentRequest,
        response_schema=AgentResponse,
        default_timeout=args.timeout,
    )
    answer = []
    try:
        request = AgentRequest(question=args.question, streaming=True)
        async for response in client.request_stream(request, timeout=args.timeout):
            print(json.dumps(dataclasses.asdict(response)), flush=True)
            if response.message_type == "answer" and response.content:
                answer.append(response.content)
            if response.end_of_dialog:
                break
    finally:
        await client.close()
        await backend.close()
    print(json.dumps({"done": True, "answer": "".join(answer)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pulsar-host", default="pulsar://localhost:6650")
    parser.add_argument("--token", default=None)
    parser.add_argument("--workspace", default="default")
    parser.add_argument("--flow", default="default")
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("question")
    args = parser.parse_args()
    # The client library logs a response it cannot read and stops reading: that must show.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        asyncio.run(ask(args))
    except asyncio.TimeoutError:
        print("no end of dialog within the timeout", file=sys.stderr)
        sys.exit(3)
    # The client library's native Pulsar client, closed above, still aborts now and then as the
    # interpreter tears down ("terminate called without an active exception", SIGABRT), after
    # the whole stream was printed: leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
