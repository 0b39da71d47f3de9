"""An MCP server on stdio that misbehaves on purpose, for the orchestrator's tests.

`slow` never answers; each `notifications/cancelled` it is sent is noted, one request id a line,
in the file named by its first argument. `flood` answers with a message that never ends: more
than the orchestrator reads of one line, then nothing.
"""

import json
import sys
import time

NOTES = sys.argv[1]
TOOLS = [
    {"name": "slow", "description": "Never answers", "inputSchema": {"type": "object", "properties": {}}},
    {"name": "flood", "description": "Answers without end", "inputSchema": {"type": "object", "properties": {}}},
]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def note(line):
    with open(NOTES, "a") as notes:
        notes.write(line + "\n")


for raw in sys.stdin:
    message = json.loads(raw)
    method, ident = message.get("method"), message.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": ident, "result": {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "misbehaving", "version": "1"}}})
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": ident, "result": {}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": ident, "result": {"tools": TOOLS}})
    elif method == "notifications/cancelled":
        note("cancelled %s" % message["params"]["requestId"])
    elif method == "tools/call" and message["params"]["name"] == "slow":
        note("called %s" % ident)
    elif method == "tools/call" and message["params"]["name"] == "flood":
        sys.stdout.write('{"jsonrpc": "2.0", "id": %s, "result": {"content": [{"type": "text", "text": "' % json.dumps(ident))
        chunk = "x" * (1 << 20)
        try:
            for _ in range(64):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        except BrokenPipeError:
            note("flood cut off")
            sys.exit(0)
        time.sleep(3600)
