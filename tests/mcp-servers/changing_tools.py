"""An MCP server on stdio whose tool list changes while it runs, for the orchestrator's tests.

It starts with one tool, `evolve`. Calling it adds `later` (which takes a `city`), tells the client
so (`notifications/tools/list_changed`) and then answers.
"""

import json
import sys

EVOLVE = {"name": "evolve", "description": "Adds a tool", "inputSchema": {"type": "object", "properties": {}}}
LATER = {"name": "later", "description": "Runs once added", "inputSchema": {
    "type": "object", "properties": {"city": {"type": "string", "description": "The city"}}, "required": ["city"]}}
tools = [EVOLVE]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def answer(ident, text):
    send({"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": text}]}})


for raw in sys.stdin:
    message = json.loads(raw)
    method, ident = message.get("method"), message.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": ident, "result": {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": {"name": "changing-tools", "version": "1"}}})
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": ident, "result": {}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": ident, "result": {"tools": tools}})
    elif method == "tools/call" and message["params"]["name"] == "evolve":
        if LATER not in tools:
            tools.append(LATER)
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        answer(ident, "evolved")
    elif method == "tools/call" and message["params"]["name"] == "later" and LATER in tools:
        answer(ident, "later ran for %s" % message["params"]["arguments"].get("city"))
    elif ident is not None:
        send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": "no such method or tool"}})
