// An MCP server over streamable HTTP built on the TypeScript SDK (`@modelcontextprotocol/sdk`,
// installed with the everything server), answering every call in JSON (`enableJsonResponse`) as
// many servers choose to, for the orchestrator's tests. It serves on 127.0.0.1 at the port given as
// its first argument. `meet` waits up to 5 s for four calls of `meet` to be under way at once and
// answers how many it saw at most ("met 4"): calls sent one at a time each see only themselves.
// `sessions` answers how many sessions were opened.
import http from "node:http";
import { randomUUID } from "node:crypto";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";

const MEET_COUNT = 4;
let underWay = 0;
let mostUnderWay = 0;
let waiting = [];

async function meet() {
  underWay += 1;
  mostUnderWay = Math.max(mostUnderWay, underWay);
  waiting.splice(0).forEach((wake) => wake());
  const deadline = Date.now() + 5000;
  while (mostUnderWay < MEET_COUNT && Date.now() < deadline) {
    await new Promise((wake) => {
      waiting.push(wake);
      setTimeout(wake, 100);
    });
  }
  const seen = mostUnderWay;
  underWay -= 1;
  if (underWay === 0) mostUnderWay = 0;
  return { content: [{ type: "text", text: `met ${seen}` }] };
}

const sessions = new Map();

function session() {
  const transport = new StreamableHTTPServerTransport({
    sessionIdGenerator: () => randomUUID(),
    enableJsonResponse: true,
    onsessioninitialized: (id) => sessions.set(id, transport),
  });
  const server = new McpServer({ name: "json-answers", version: "1" });
  server.tool("meet", "Waits for four calls of meet under way at once", meet);
  server.tool("echo", "Answers echoed", async () => ({ content: [{ type: "text", text: "echoed" }] }));
  server.tool("sessions", "Answers how many sessions were opened", async () => ({
    content: [{ type: "text", text: String(sessions.size) }],
  }));
  return server.connect(transport).then(() => transport);
}

http
  .createServer(async (request, response) => {
    let body = "";
    for await (const chunk of request) body += chunk;
    const known = sessions.get(request.headers["mcp-session-id"]);
    const transport = known ?? (await session());
    await transport.handleRequest(request, response, body ? JSON.parse(body) : undefined);
  })
  .listen(Number(process.argv[2]), "127.0.0.1");
