"""An MCP server over streamable HTTP that misbehaves on purpose, for the orchestrator's tests.

It serves on 127.0.0.1 at the port given as its first argument. `flood-json` answers a call with
one JSON message of over 64 MiB (its text all "x"), and `flood-events` with an event stream whose
one line is as long: well-formed, only too long to read. `junk-events` answers with an event
stream of 400,000 events that are no message (data that is not JSON-RPC, pings), then its answer,
"after the junk". `echo` answers "echoed". Given `broken-get` as its second argument, its event stream (`GET`)
breaks each time just after it opens (fewer bytes than its length says); `gets` answers how many
were asked for. `meet` waits up to 5 s for four calls of `meet` to be under way at once and answers
how many it saw at most ("met 4"): calls sent one at a time each see only themselves. `sessions`
answers how many sessions were opened (`initialize` requests).
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOOLS = [
    {"name": name, "description": description, "inputSchema": {"type": "object", "properties": {}}}
    for name, description in [
        ("flood-json", "Answers with one JSON message of 64 MiB"),
        ("flood-events", "Answers with an event line of 64 MiB"),
        ("junk-events", "Answers after 400,000 events that are no message"),
        ("echo", "Answers echoed"),
        ("gets", "Answers how many event streams were asked for"),
        ("meet", "Waits for four calls of meet under way at once"),
        ("sessions", "Answers how many sessions were opened"),
    ]
]
BROKEN_GET = sys.argv[2:3] == ["broken-get"]
GETS = 0
SESSION = "misbehaving-http"
MEETING = threading.Condition()
MEET_COUNT = 4
UNDER_WAY = 0
MOST_UNDER_WAY = 0
SESSIONS = 0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def head(self, status, content_type=None, length=None):
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Mcp-Session-Id", SESSION)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def reply(self, ident, result):
        body = json.dumps({"jsonrpc": "2.0", "id": ident, "result": result}).encode()
        self.head(200, "application/json", len(body))
        self.wfile.write(body)

    def flood(self, ident, content_type, before, after):
        # No length: the body ends when the connection closes (HTTP/1.0).
        self.head(200, content_type)
        opening = '{"jsonrpc": "2.0", "id": %s, "result": {"content": [{"type": "text", "text": "'
        try:
            self.wfile.write((before + opening % json.dumps(ident)).encode())
            chunk = b"x" * (1 << 20)
            for _ in range(64):
                self.wfile.write(chunk)
            self.wfile.write(('"}]}}' + after).encode())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def junk(self, ident):
        self.head(200, "text/event-stream")
        answer = {"jsonrpc": "2.0", "id": ident,
                  "result": {"content": [{"type": "text", "text": "after the junk"}]}}
        try:
            # In few large writes, so that a reader finds many events ready at once.
            run = b"data: x\n\n" * 1000 + b"event: ping\ndata: {}\n\n" * 1000
            for _ in range(200):
                self.wfile.write(run)
            self.wfile.write(("data: " + json.dumps(answer) + "\n\n").encode())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def meet(self, ident):
        global UNDER_WAY, MOST_UNDER_WAY
        with MEETING:
            UNDER_WAY += 1
            MOST_UNDER_WAY = max(MOST_UNDER_WAY, UNDER_WAY)
            MEETING.notify_all()
            MEETING.wait_for(lambda: MOST_UNDER_WAY >= MEET_COUNT, timeout=5)
            seen = MOST_UNDER_WAY
            UNDER_WAY -= 1
            if UNDER_WAY == 0:
                MOST_UNDER_WAY = 0
        self.reply(ident, {"content": [{"type": "text", "text": "met %d" % seen}]})

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        message = json.loads(self.rfile.read(length))
        method, ident = message.get("method"), message.get("id")
        if ident is None:
            self.head(202, length=0)
        elif method == "initialize":
            global SESSIONS
            SESSIONS += 1
            self.reply(ident, {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "misbehaving-http", "version": "1"}})
        elif method == "ping":
            self.reply(ident, {})
        elif method == "tools/list":
            self.reply(ident, {"tools": TOOLS})
        elif method == "tools/call" and message["params"]["name"] == "flood-json":
            self.flood(ident, "application/json", "", "")
        elif method == "tools/call" and message["params"]["name"] == "flood-events":
            self.flood(ident, "text/event-stream", "data: ", "\n\n")
        elif method == "tools/call" and message["params"]["name"] == "junk-events":
            self.junk(ident)
        elif method == "tools/call" and message["params"]["name"] == "meet":
            self.meet(ident)
        elif method == "tools/call" and message["params"]["name"] == "sessions":
            self.reply(ident, {"content": [{"type": "text", "text": str(SESSIONS)}]})
        elif method == "tools/call" and message["params"]["name"] == "gets":
            self.reply(ident, {"content": [{"type": "text", "text": str(GETS)}]})
        elif method == "tools/call":
            self.reply(ident, {"content": [{"type": "text", "text": "echoed"}]})
        else:
            body = json.dumps({"jsonrpc": "2.0", "id": ident,
                               "error": {"code": -32601, "message": "no such method"}}).encode()
            self.head(200, "application/json", len(body))
            self.wfile.write(body)

    def do_GET(self):
        global GETS
        if not BROKEN_GET:
            self.head(405, length=0)
            return
        GETS += 1
        # Closed (HTTP/1.0) after 9 of the 1000 bytes its length promises.
        self.head(200, "text/event-stream", 1000)
        try:
            self.wfile.write(b": hello\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_DELETE(self):
        self.head(200, length=0)


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
