"""Makes config calls as TrustGraph 2.11's API gateway makes a workspace's: on the workspace's own
request topic (the gateway's DispatcherManager names it `<config request queue>:<workspace>`, the
answers `<config response queue>:<workspace>`), through trustgraph-base's RequestResponseClient
and its Pulsar backend, with the gateway's config translators, one client per workspace kept for
every call as the gateway keeps its dispatchers. (The gateway itself needs trustgraph-flow's web
server and an IAM service; its config dispatcher is these pieces.)

Reads one JSON call per line on stdin: {"workspace": ..., "request": {gateway JSON}, "timeout":
seconds}. Prints {"ready": true} first, then per call {"answer": {gateway JSON}, "error": {type,
message} or null} or {"timeout": true}.

The config test (tests/tests/config.rs) runs it against config-svc."""

import argparse
import asyncio
import json
import logging
import sys

from trustgraph.base.async_pulsar_backend import AsyncPulsarBackend
from trustgraph.base.request_response_client import RequestResponseClient
from trustgraph.messaging import TranslatorRegistry
from trustgraph.schema import (
    ConfigRequest,
    ConfigResponse,
    config_request_queue,
    config_response_queue,
)


def say(**line):
    print(json.dumps(line), flush=True)


async def serve(args):
    backend = AsyncPulsarBackend(host=args.pulsar_host, api_key=None)
    to_request = TranslatorRegistry.get_request_translator("config")
    from_response = TranslatorRegistry.get_response_translator("config")
    clients = {}
    say(ready=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        call = json.loads(line)
        workspace = call["workspace"]
        if workspace not in clients:
            # As the gateway's DispatcherManager.invoke_global_service names a workspace's queues.
            clients[workspace] = await RequestResponseClient.create(
                backend=backend,
                request_topic=f"{config_request_queue}:{workspace}",
                response_topic=f"{config_response_queue}:{workspace}",
                request_schema=ConfigRequest,
                response_schema=ConfigResponse,
            )
        try:
            response = await clients[workspace].request(
                to_request.decode(call["request"]), timeout=call.get("timeout", 20)
            )
        except asyncio.TimeoutError:
            say(timeout=True)
            continue
        answer, _final = from_response.encode_with_completion(response)
        # The gateway's translator leaves the error out; the gateway counts it, so the test reads it.
        error = response.error and {"type": response.error.type, "message": response.error.message}
        say(answer=answer, error=error)
    for client in clients.values():
        await client.close()
    await backend.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pulsar-host", required=True)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
