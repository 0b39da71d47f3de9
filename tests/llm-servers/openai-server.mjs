// A small OpenAI-compatible chat server around a real GGUF model, for the tests.
//
//   node openai-server.mjs --model PATH [--port 0] [--host 127.0.0.1] [--context-size 4096]
//                          [--threads 1] [--seed 42] [--max-tokens 512] [--repeat-penalty 1]
//                          [--model-name NAME]
//
// Prints `listening on http://HOST:PORT` on stdout once the model is loaded; logs go to stderr.
// Endpoints: GET /v1/models, GET /health, POST /v1/chat/completions (whole or streamed answers).
//
// The model runs on the CPU through node-llama-cpp's prebuilt llama.cpp binary (never compiled
// here). Prompts are rendered with the model's own Jinja chat template. Each request is independent:
// the context is cleared before each one, and requests are answered one at a time, in order of
// arrival (the model has a single context). `temperature` defaults to 0 (greedy), so answers are
// reproducible; a sampled answer uses the request's `seed`, else the server's.
//
// One thread by default: llama.cpp's threads wait for each other by spinning, so with a build
// running on the other core two threads are several times slower than one.
//
// Beyond OpenAI: `max_tokens` defaults to --max-tokens (a tiny model may otherwise loop until its
// context is full); there is no repetition penalty unless --repeat-penalty, `frequency_penalty`,
// `presence_penalty` or `repeat_penalty` (as llama.cpp's server calls it) asks for one. Tools use
// node-llama-cpp's own function-calling syntax, which it adds to the system prompt (the model's
// template knows no tools).

import http from "node:http";
import path from "node:path";
import {getLlama, LlamaChat, JinjaTemplateChatWrapper, resolveChatWrapper} from "node-llama-cpp";

function parseArgs(argv) {
    const opts = {
        model: null, port: 0, host: "127.0.0.1", contextSize: 4096, threads: 1, seed: 42,
        maxTokens: 512, repeatPenalty: 1, modelName: null
    };
    const names = {
        "--model": ["model", String], "--port": ["port", Number], "--host": ["host", String],
        "--context-size": ["contextSize", Number], "--threads": ["threads", Number],
        "--seed": ["seed", Number], "--max-tokens": ["maxTokens", Number],
        "--repeat-penalty": ["repeatPenalty", Number], "--model-name": ["modelName", String]
    };
    for (let i = 0; i < argv.length; i++) {
        let [flag, value] = argv[i].split(/=(.*)/s, 2);
        const known = names[flag];
        if (known == null) usage(`unknown argument ${argv[i]}`);
        if (value === undefined) value = argv[++i];
        if (value === undefined) usage(`${flag} needs a value`);
        const parsed = known[1](value);
        if (typeof parsed === "number" && !Number.isFinite(parsed)) usage(`${flag} needs a number`);
        opts[known[0]] = parsed;
    }
    if (!opts.model) usage("--model PATH is required");
    opts.modelName ??= path.basename(opts.model).replace(/\.gguf$/i, "");
    return opts;
}

function usage(message) {
    process.stderr.write(`openai-server: ${message}\nusage: node openai-server.mjs --model PATH [--port PORT]\n`);
    process.exit(2);
}

const opts = parseArgs(process.argv.slice(2));
const log = (...parts) => process.stderr.write(`openai-server: ${parts.join(" ")}\n`);

const loadStart = Date.now();
const llama = await getLlama({
    gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true, progressLogs: false,
    logLevel: "error"
});
const model = await llama.loadModel({modelPath: opts.model});
const context = await model.createContext({
    contextSize: Math.min(opts.contextSize, model.trainContextSize), sequences: 1,
    threads: opts.threads
});
const sequence = context.getSequence();
const template = model.fileInfo.metadata?.tokenizer?.chat_template;
const chatWrapper = typeof template === "string"
    ? new JinjaTemplateChatWrapper({template})
    : resolveChatWrapper(model);
const chat = new LlamaChat({contextSequence: sequence, chatWrapper, autoDisposeSequence: false});
let jsonGrammar = null;
const created = Math.floor(Date.now() / 1000);
log(`loaded ${opts.modelName} in ${Date.now() - loadStart} ms (context ${context.contextSize} tokens,`,
    `${chatWrapper.wrapperName} chat wrapper)`);

// ---- requests ----

class HttpError extends Error {
    constructor(status, message, type = "invalid_request_error") {
        super(message);
        this.status = status;
        this.type = type;
    }
}

const bad = (message) => new HttpError(400, message);

function textOf(content, role) {
    if (content == null) return "";
    if (typeof content === "string") return content;
    if (Array.isArray(content)) {
        return content.map((part) => {
            if (typeof part === "string") return part;
            if (part?.type === "text" && typeof part.text === "string") return part.text;
            throw bad(`only text content parts are supported (a ${role} message has a ${part?.type} part)`);
        }).join("");
    }
    throw bad(`a ${role} message's content must be a string or a list of text parts`);
}

function parseArguments(call) {
    const raw = call?.function?.arguments;
    if (raw == null || raw === "") return {};
    if (typeof raw !== "string") return raw;
    try {
        return JSON.parse(raw);
    } catch {
        return raw;
    }
}

// OpenAI messages to node-llama-cpp's chat history. An assistant's tool calls become function
// calls whose results are the matching `tool` messages; a tool message that answers no call is
// given to the model as a user message.
function toHistory(messages) {
    if (!Array.isArray(messages) || messages.length === 0) throw bad("messages must be a non-empty list");
    const history = [];
    const pendingCalls = new Map();
    for (const [i, message] of messages.entries()) {
        const role = message?.role;
        if (role === "system" || role === "developer") {
            history.push({type: "system", text: textOf(message.content, role)});
        } else if (role === "user") {
            history.push({type: "user", text: textOf(message.content, role)});
        } else if (role === "assistant") {
            const response = [];
            const text = textOf(message.content, role);
            if (text !== "") response.push(text);
            for (const call of message.tool_calls ?? []) {
                const item = {
                    type: "functionCall", name: String(call?.function?.name ?? ""),
                    params: parseArguments(call), result: null
                };
                response.push(item);
                if (call?.id != null) pendingCalls.set(call.id, item);
            }
            history.push({type: "model", response});
        } else if (role === "tool" || role === "function") {
            const content = textOf(message.content, role);
            const call = pendingCalls.get(message.tool_call_id)
                ?? (role === "function" ? findOpenCall(history, message.name) : undefined);
            if (call != null) {
                call.result = content;
                pendingCalls.delete(message.tool_call_id);
            } else {
                const name = message.name ? ` (${message.name})` : "";
                history.push({type: "user", text: `Tool result${name}: ${content}`});
            }
        } else {
            throw bad(`messages[${i}] has an unknown role ${JSON.stringify(role)}`);
        }
    }
    const last = history.at(-1);
    const continuesAfterToolResults = last?.type === "model"
        && last.response.at(-1)?.type === "functionCall";
    if (!continuesAfterToolResults) history.push({type: "model", response: []});
    return history;
}

function findOpenCall(history, name) {
    const last = history.at(-1);
    if (last?.type !== "model") return undefined;
    return last.response.find((r) => r.type === "functionCall" && r.result === null && r.name === name);
}

function toFunctions(tools, toolChoice) {
    if (tools == null || toolChoice === "none") return undefined;
    if (!Array.isArray(tools)) throw bad("tools must be a list");
    if (toolChoice != null && toolChoice !== "auto")
        throw bad('only tool_choice "auto" and "none" are supported');
    const functions = {};
    for (const tool of tools) {
        if (tool?.type !== "function" || typeof tool.function?.name !== "string")
            throw bad('each tool must be {"type": "function", "function": {"name": ...}}');
        functions[tool.function.name] = {
            description: tool.function.description,
            params: tool.function.parameters ?? undefined
        };
    }
    return Object.keys(functions).length > 0 ? functions : undefined;
}

async function grammarFor(format) {
    if (format == null || format.type === "text") return undefined;
    if (format.type === "json_object") {
        jsonGrammar ??= await llama.getGrammarFor("json");
        return jsonGrammar;
    }
    if (format.type === "json_schema") {
        const schema = format.json_schema?.schema;
        if (schema == null || typeof schema !== "object") throw bad("response_format.json_schema.schema is required");
        try {
            return await llama.createGrammarForJsonSchema(schema);
        } catch (e) {
            throw bad(`unsupported JSON schema: ${e.message}`);
        }
    }
    throw bad(`unsupported response_format type ${JSON.stringify(format.type)}`);
}

function number(body, name, {min = -Infinity, max = Infinity, integer = false} = {}) {
    const v = body[name];
    if (v == null) return undefined;
    if (typeof v !== "number" || !Number.isFinite(v) || v < min || v > max || (integer && !Number.isInteger(v)))
        throw bad(`${name} must be ${integer ? "an integer" : "a number"} between ${min} and ${max}`);
    return v;
}

function stopsOf(stop) {
    if (stop == null) return [];
    const list = Array.isArray(stop) ? stop : [stop];
    if (!list.every((s) => typeof s === "string")) throw bad("stop must be a string or a list of strings");
    return list.filter((s) => s !== "");
}

// Checks and converts one request; throws HttpError(400) before any generation starts.
async function prepare(body) {
    if (body == null || typeof body !== "object" || Array.isArray(body)) throw bad("the body must be a JSON object");
    if ((body.n ?? 1) !== 1) throw bad("only n = 1 is supported");
    const history = toHistory(body.messages);
    const functions = toFunctions(body.tools, body.tool_choice);
    const grammar = await grammarFor(body.response_format);
    if (functions && grammar) throw bad("response_format cannot be combined with tools here");
    const maxTokens = number(body, "max_completion_tokens", {min: 1, integer: true})
        ?? number(body, "max_tokens", {min: 1, integer: true}) ?? opts.maxTokens;
    const frequencyPenalty = number(body, "frequency_penalty", {min: -2, max: 2});
    const presencePenalty = number(body, "presence_penalty", {min: -2, max: 2});
    const repeatPenalty = number(body, "repeat_penalty", {min: 0}) ?? opts.repeatPenalty;
    const penalise = repeatPenalty !== 1 || frequencyPenalty || presencePenalty;
    return {
        history,
        stream: body.stream === true,
        includeUsage: body.stream_options?.include_usage === true,
        options: {
            maxTokens,
            temperature: number(body, "temperature", {min: 0, max: 2}) ?? 0,
            topP: number(body, "top_p", {min: 0, max: 1}),
            seed: number(body, "seed", {integer: true}) ?? opts.seed,
            customStopTriggers: stopsOf(body.stop),
            repeatPenalty: penalise
                ? {penalty: repeatPenalty, frequencyPenalty, presencePenalty}
                : false,
            ...(functions ? {functions, documentFunctionParams: true, maxParallelFunctionCalls: 4} : {}),
            ...(grammar ? {grammar} : {})
        }
    };
}

let nextId = 0;
const callId = () => `call_${Date.now().toString(36)}${(nextId++).toString(36)}`;

// Generates one answer: the context is cleared first, so nothing carries over between requests.
async function generate({history, options}, {onText, signal}) {
    await sequence.clearHistory();
    const promptTokens = chatWrapper.generateContextState({
        chatHistory: history, availableFunctions: options.functions,
        documentFunctionParams: options.documentFunctionParams
    }).contextText.tokenize(model.tokenizer).length;
    let completionTokens = 0;
    const result = await chat.generateResponse(history, {
        ...options,
        signal, stopOnAbortSignal: true,
        onTextChunk: onText,
        onToken: (tokens) => { completionTokens += tokens.length; }
    });
    const toolCalls = (result.functionCalls ?? []).map((call, index) => ({
        index, id: callId(), type: "function",
        function: {name: call.functionName, arguments: JSON.stringify(call.params ?? {})}
    }));
    // onToken does not see the tokens of a function call; the sequence holds every token but the
    // last one generated.
    if (toolCalls.length > 0)
        completionTokens = Math.max(completionTokens, sequence.nextTokenIndex - promptTokens + 1);
    const reason = result.metadata.stopReason;
    const finishReason = toolCalls.length > 0 ? "tool_calls" : reason === "maxTokens" ? "length" : "stop";
    return {
        text: result.response, toolCalls, finishReason, stopReason: reason,
        usage: {
            prompt_tokens: promptTokens, completion_tokens: completionTokens,
            total_tokens: promptTokens + completionTokens
        }
    };
}

// One request at a time: the model has a single context.
let queue = Promise.resolve();
function exclusively(task) {
    const run = queue.then(task, task);
    queue = run.catch(() => {});
    return run;
}

async function chatCompletions(req, res, body) {
    const request = await prepare(body);
    const id = `chatcmpl-${Date.now().toString(36)}${(nextId++).toString(36)}`;
    const abort = new AbortController();
    res.on("close", () => { if (!res.writableFinished) abort.abort(); });
    const base = {id, created: Math.floor(Date.now() / 1000), model: opts.modelName, system_fingerprint: "node-llama-cpp"};

    if (!request.stream) {
        const out = await exclusively(() => abort.signal.aborted ? null : generate(request, {signal: abort.signal}));
        if (out == null || abort.signal.aborted) return;
        const message = {role: "assistant", content: out.toolCalls.length > 0 && out.text === "" ? null : out.text};
        if (out.toolCalls.length > 0) message.tool_calls = out.toolCalls.map(({index, ...call}) => call);
        sendJson(res, 200, {
            ...base, object: "chat.completion",
            choices: [{index: 0, message, logprobs: null, finish_reason: out.finishReason}],
            usage: out.usage
        });
        return;
    }

    res.writeHead(200, {"content-type": "text/event-stream", "cache-control": "no-cache", connection: "keep-alive"});
    const send = (data) => res.write(`data: ${JSON.stringify(data)}\n\n`);
    const chunk = (delta, finishReason = null) => send({
        ...base, object: "chat.completion.chunk",
        choices: [{index: 0, delta, logprobs: null, finish_reason: finishReason}],
        ...(request.includeUsage ? {usage: null} : {})
    });
    try {
        const out = await exclusively(async () => {
            if (abort.signal.aborted) return null;
            chunk({role: "assistant", content: ""});
            return generate(request, {signal: abort.signal, onText: (text) => { if (text !== "") chunk({content: text}); }});
        });
        if (out == null || abort.signal.aborted) return;
        if (out.toolCalls.length > 0) chunk({tool_calls: out.toolCalls});
        chunk({}, out.finishReason);
        if (request.includeUsage)
            send({...base, object: "chat.completion.chunk", choices: [], usage: out.usage});
        res.write("data: [DONE]\n\n");
    } catch (e) {
        log(`error while streaming: ${e.stack ?? e}`);
        send({error: {message: String(e.message ?? e), type: "server_error"}});
    }
    res.end();
}

function sendJson(res, status, body) {
    const text = JSON.stringify(body);
    res.writeHead(status, {"content-type": "application/json", "content-length": Buffer.byteLength(text)});
    res.end(text);
}

function readBody(req) {
    return new Promise((resolve, reject) => {
        const parts = [];
        let size = 0;
        req.on("data", (part) => {
            size += part.length;
            if (size > 16 * 1024 * 1024) reject(new HttpError(413, "the body is too large"));
            else parts.push(part);
        });
        req.on("end", () => resolve(Buffer.concat(parts).toString("utf8")));
        req.on("error", reject);
    });
}

const server = http.createServer(async (req, res) => {
    try {
        const url = new URL(req.url, "http://localhost");
        const route = url.pathname.replace(/\/+$/, "");
        if (req.method === "GET" && (route === "/v1/models" || route === "/models")) {
            sendJson(res, 200, {object: "list", data: [{id: opts.modelName, object: "model", created, owned_by: "local"}]});
        } else if (req.method === "GET" && route === "/health") {
            sendJson(res, 200, {status: "ok"});
        } else if (req.method === "POST" && (route === "/v1/chat/completions" || route === "/chat/completions")) {
            let body;
            try {
                body = JSON.parse(await readBody(req));
            } catch (e) {
                throw e instanceof HttpError ? e : bad(`the body is not JSON: ${e.message}`);
            }
            await chatCompletions(req, res, body);
        } else {
            throw new HttpError(404, `no route for ${req.method} ${url.pathname}`, "not_found_error");
        }
    } catch (e) {
        const status = e instanceof HttpError ? e.status : 500;
        if (status === 500) log(`error: ${e.stack ?? e}`);
        if (!res.headersSent) sendJson(res, status, {error: {message: e.message, type: e.type ?? "server_error", code: null}});
        else res.end();
    }
});

server.listen(opts.port, opts.host, () => {
    const {port} = server.address();
    process.stdout.write(`listening on http://${opts.host}:${port}\n`);
});

async function shutdown() {
    server.close();
    await llama.dispose().catch(() => {});
    process.exit(0);
}
process.on("SIGTERM", shutdown);
process.on("SIGINT", shutdown);
