"""Hears config pushes as a TrustGraph 2.11 workspace service does (trustgraph-base): its Pulsar
backend on TrustGraph's config push queue, its schema and decoding, and the push handling of its
own `AsyncProcessor.on_config_notify` with `WorkspaceProcessor`'s workspace handler and, for the
types given with --types, a config handler fed by TrustGraph's own config fetch (its
request/response client on the config request queue). Prints one JSON line as it listens
({"ready": true}), then one for each push ({"push": version}), for each workspace the service takes
up ({"created": id}) or drops ({"deleted": id}), and for each workspace's config of those types
it reads ({"config": {"workspace": id, "values": {type: {key: value}}}}).

The config test (tests/tests/config.rs) runs it against config-svc."""

import argparse
import asyncio
import functools
import json
import logging
import uuid

from trustgraph.base.async_processor import AsyncProcessor
from trustgraph.base.async_pulsar_backend import AsyncPulsarBackend
from trustgraph.base.workspace_processor import WorkspaceProcessor
from trustgraph.schema import ConfigPush, config_push_queue


def say(**line):
    print(json.dumps(line), flush=True)


class WorkspaceService:
    """What TrustGraph's push handling reads of a service: the version it has seen, its config
    handler (for the types given, if any), its workspace handler, the workspaces it serves, and
    what it fetches config with."""

    def __init__(self, backend, types):
        self.id = f"workspace-events-{uuid.uuid4().hex[:8]}"
        self.config_version = 0
        self.config_handlers = []
        if types:
            self.config_handlers.append({"handler": self.on_config, "types": set(types)})
        self.active_workspaces = set()
        self.workspace_handlers = [
            functools.partial(WorkspaceProcessor._handle_workspace_changes, self)
        ]
        # What TrustGraph's push handling fetches a changed type's values with.
        self.async_backend = backend
        self.config_timeout = 20
        self._create_config_client = functools.partial(
            AsyncProcessor._create_config_client, self
        )
        self._fetch_type_workspace = functools.partial(
            AsyncProcessor._fetch_type_workspace, self
        )

    async def on_config(self, workspace, config, version):
        say(config={"workspace": workspace, "values": config})

    async def on_workspace_created(self, workspace):
        say(created=workspace)

    async def on_workspace_deleted(self, workspace):
        say(deleted=workspace)


async def listen(args):
    backend = AsyncPulsarBackend(host=args.pulsar_host, api_key=None)
    pushes = await backend.create_consumer(
        topic=config_push_queue,
        subscription=str(uuid.uuid4()),
        schema=ConfigPush,
        initial_position="latest",
    )
    service = WorkspaceService(backend, args.types)
    say(ready=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.seconds
    while loop.time() < deadline:
        try:
            message = await asyncio.wait_for(pushes.receive(), deadline - loop.time())
        except asyncio.TimeoutError:
            break
        await pushes.acknowledge(message)
        say(push=message.value().version)
        await AsyncProcessor.on_config_notify(service, message, None, None)
    await pushes.close()
    await backend.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pulsar-host", required=True)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--types", nargs="*", default=[])
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(listen(parser.parse_args()))


if __name__ == "__main__":
    main()
