"""A stand-in OTLP trace collector for tests/tests/tracing.rs.

Over HTTP, reads `POST /v1/traces` as an OpenTelemetry collector does: binary protobuf
(`application/x-protobuf`) decoded by OpenTelemetry's own generated classes
(opentelemetry-proto), gzip when `Content-Encoding` says so. With `grpc` as the third argument it
serves OTLP's gRPC trace service instead (grpcio, the generated service). Every request must carry
the header named by the first argument with the value of the second (a hosted backend's key); one
without it is answered 401 (gRPC: UNAUTHENTICATED), as such a backend would. Prints
`{"listening": PORT}` once, then one JSON line per span received and one per request refused,
flushed at once.

With `COLLECTOR_TLS` set to a directory holding `collector.pem`, `collector.key` and `ca.pem`, it
serves over TLS (HTTPS, or gRPC with TLS) and takes only clients that show a certificate `ca.pem`
signed, as a collector set up for mutual TLS does; a client without one fails its handshake.

    python collector.py HEADER VALUE [grpc]
"""

import gzip
import json
import os
import ssl
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

HEADER, VALUE = sys.argv[1], sys.argv[2]
TLS = os.environ.get("COLLECTOR_TLS")


def tls_file(name):
    with open(os.path.join(TLS, name), "rb") as f:
        return f.read()


def say(line):
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def report(request, gzipped):
    for resource_spans in request.resource_spans:
        resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                say(
                    {
                        "service": resource.get("service.name", ""),
                        "resource": resource,
                        "scope": scope_spans.scope.name,
                        "name": span.name,
                        "trace": span.trace_id.hex(),
                        "id": span.span_id.hex(),
                        "parent": span.parent_span_id.hex(),
                        "kind": span.kind,
                        "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano,
                        "attributes": {a.key: a.value.string_value for a in span.attributes},
                        "gzip": gzipped,
                    }
                )


class Collector(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def refuse(self, status, why):
        say({"refused": why, "status": status})
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/traces":
            return self.refuse(404, "path " + self.path)
        if self.headers.get(HEADER) != VALUE:
            return self.refuse(401, "no " + HEADER)
        if self.headers.get("Content-Type") != "application/x-protobuf":
            return self.refuse(415, "content type " + str(self.headers.get("Content-Type")))
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding:
            return self.refuse(415, "encoding " + encoding)
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception as e:  # a body the protocol's own classes cannot read
            return self.refuse(400, "not an ExportTraceServiceRequest: %s" % e)
        report(request, encoding == "gzip")
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


def serve_grpc():
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            metadata = dict(context.invocation_metadata())
            if metadata.get(HEADER.lower()) != VALUE:
                say({"refused": "no " + HEADER, "status": "UNAUTHENTICATED"})
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "no " + HEADER)
            # grpcio decompresses before this; whether the message came gzipped is not told.
            report(request, None)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    if TLS:
        credentials = grpc.ssl_server_credentials(
            [(tls_file("collector.key"), tls_file("collector.pem"))],
            root_certificates=tls_file("ca.pem"),
            require_client_auth=True,
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    say({"listening": port})
    server.wait_for_termination()


if sys.argv[3:] == ["grpc"]:
    serve_grpc()
else:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    if TLS:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(os.path.join(TLS, "collector.pem"), os.path.join(TLS, "collector.key"))
        context.load_verify_locations(os.path.join(TLS, "ca.pem"))
        context.verify_mode = ssl.CERT_REQUIRED
        # A client without a certificate fails its handshake in accept(), which the server
        # takes as a failed request and goes on.
        server.socket = context.wrap_socket(server.socket, server_side=True)
    say({"listening": server.server_address[1]})
    server.serve_forever()
