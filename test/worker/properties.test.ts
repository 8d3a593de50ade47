/**
 * Property-based tests of invariant 6 over every route (issue 4, "Bad input
 * and abuse"): whatever arrives — arbitrary and malformed JSON, wrong types,
 * huge strings, deep nesting, Unicode edge cases (lone surrogates written as
 * escapes in the raw JSON text), very long histories, random paths, methods
 * and keys — the answer is a success or a JSON error with a code and a 4xx or
 * 503 status, never a 500 and never a hang, and a rejected request writes
 * nothing.
 *
 * Runs are bounded (a fixed seed per property would hide new cases, so the
 * seed is random; fast-check prints it with the shrunk input on a failure).
 */
import { env, exports } from "cloudflare:workers";
import fc from "fast-check";
import { beforeAll, describe, expect, it, vi } from "vitest";
import { LIMITS } from "../../core/api.ts";
import { ROOT_ID, ROOT_KEY, bash, project, type Reply } from "./helpers.ts";

/** A request that takes longer than this counts as a hang. */
const HANG_MS = 15_000;
// Each property runs many requests; the file as a whole stays under a minute.
vi.setConfig({ testTimeout: 60_000 });

let main: Awaited<ReturnType<typeof project>>;
let other: Awaited<ReturnType<typeof project>>;
/** Registers hosts: kept apart, so that no rollout ever calls a random URL. */
let hostsProject: Awaited<ReturnType<typeof project>>;
let revoked: string;
let keyIds: string[];

beforeAll(async () => {
	main = await project("props");
	other = await project("props-b");
	hostsProject = await project("props-hosts");
	const made = await send("POST", "/v1/keys", {
		key: ROOT_KEY,
		json: { project: "props", role: "trainer" },
	});
	revoked = made.body.key;
	await send("DELETE", `/v1/keys/${made.body.id}`, { key: ROOT_KEY });
	// Spare keys of props-b for the key routes to rotate and revoke: never
	// the ones the properties send with.
	keyIds = [];
	for (const role of ["trainer", "host", "admin", "trainer"]) {
		const spare = await send("POST", "/v1/keys", {
			key: ROOT_KEY,
			json: { project: "props-b", role },
		});
		keyIds.push(spare.body.id);
	}
});

/** Sends a request; a reply that does not come in HANG_MS fails the test. */
async function send(
	method: string,
	path: string,
	opts: {
		key?: string;
		json?: unknown;
		body?: BodyInit;
		headers?: Record<string, string>;
	} = {},
): Promise<Reply> {
	const headers: Record<string, string> = { ...opts.headers };
	if (opts.key !== undefined) headers.authorization = `Bearer ${opts.key}`;
	let body = opts.body;
	if (opts.json !== undefined) {
		headers["content-type"] ??= "application/json";
		body = JSON.stringify(opts.json);
	}
	const what = `${method} ${path}`;
	let timer: ReturnType<typeof setTimeout> | undefined;
	const hang = new Promise<never>((_, reject) => {
		timer = setTimeout(
			() => reject(new Error(`no answer in ${HANG_MS} ms: ${what}`)),
			HANG_MS,
		);
	});
	try {
		return await Promise.race([
			(async () => {
				const res = await exports.default.fetch(
					new Request(`https://trellis.test${path}`, {
						method,
						headers,
						body: method === "GET" || method === "HEAD" ? undefined : body,
					}),
				);
				const text = await res.text();
				let parsed: unknown = text;
				if (text !== "" && res.headers.get("content-type")?.includes("json")) {
					parsed = JSON.parse(text);
				}
				return { status: res.status, body: parsed, headers: res.headers };
			})(),
			hang,
		]);
	} finally {
		clearTimeout(timer);
	}
}

/**
 * Percent-encodes any string; a lone surrogate (which has no UTF-8 form)
 * becomes U+FFFD, as a URL parser would make it.
 */
const enc = (s: string) => encodeURIComponent(s.toWellFormed());

const ok = (r: Reply) => r.status >= 200 && r.status < 300;

/** A success, or a JSON error with a code, a message and a 4xx/503 status. */
function expectWellFormed(r: Reply, what: string, method = "POST"): void {
	if (ok(r)) return;
	const where = `${what} → ${r.status} ${JSON.stringify(r.body)?.slice(0, 300)}`;
	expect((r.status >= 400 && r.status < 500) || r.status === 503, where).toBe(
		true,
	);
	if (method === "HEAD") return;
	expect(typeof r.body?.error?.code, where).toBe("string");
	expect(typeof r.body?.error?.message, where).toBe("string");
	if (r.status === 429 || r.status === 503) {
		expect(r.headers.get("retry-after"), where).toMatch(/^\d+$/);
	}
}

// ---------------------------------------------------------------- inputs

function nested(depth: number, leaf: unknown, objects: boolean): unknown {
	let v = leaf;
	for (let i = 0; i < depth; i++) v = objects ? { k: v } : [v];
	return v;
}

const loneSurrogates = fc.constantFrom("\ud800", "\udbff", "\udc00", "\udfff");
/** Strings a parser may trip on: controls, BOM, combining marks, RTL, emoji, halves of pairs. */
const edgyString = fc
	.array(
		fc.oneof(
			fc.string({ unit: "binary", maxLength: 8 }),
			loneSurrogates,
			fc.constantFrom(
				"\u0000",
				"\ufeff",
				"e\u0301",
				"\u202e",
				"\ud83d\ude00",
				"\uffff",
				"\\",
				'"',
				"%",
				"%00",
				"../",
			),
		),
		{ maxLength: 6 },
	)
	.map((parts) => parts.join(""));
const hugeString = fc
	.integer({ min: 10_000, max: 300_000 })
	.map((n) => "x".repeat(n));
const text = fc.oneof(fc.string(), edgyString);
// Deep enough to pass any sane depth check; deeper values go as raw text
// (deepArgs), since JSON.stringify itself recurses.
const deep = fc
	.tuple(fc.integer({ min: 1, max: 1_000 }), fc.boolean())
	.map(([d, objects]) => nested(d, "leaf", objects));
const anyJson: fc.Arbitrary<unknown> = fc.oneof(
	{ weight: 8, arbitrary: fc.jsonValue({ maxDepth: 3 }) },
	{ weight: 4, arbitrary: text },
	{ weight: 1, arbitrary: hugeString },
	{ weight: 2, arbitrary: deep },
	{
		weight: 4,
		arbitrary: fc.constantFrom(
			null,
			0,
			-1,
			1.5,
			-0,
			1e308,
			Number.MAX_SAFE_INTEGER + 2,
			true,
			"",
			[],
			{},
		),
	},
);
/** Either what the schema wants, or anything at all. */
const field = <T>(good: fc.Arbitrary<T>) =>
	fc.oneof({ weight: 3, arbitrary: good }, { weight: 1, arbitrary: anyJson });
const id = fc.oneof(
	fc.constant(ROOT_ID),
	fc.stringMatching(/^[0-9a-f]{64}$/),
	text,
);
const call = fc.record(
	{
		tool: field(fc.constantFrom("bash", "sql", "t")),
		args: anyJson,
		mutates: field(fc.boolean()),
	},
	{ requiredKeys: [] },
);
/** Histories around the 4,096-call cap, and past the 1 MiB body limit. */
const longHistory = fc
	.integer({ min: LIMITS.maxCalls - 8, max: LIMITS.maxCalls + 8 })
	.map((n) => Array.from({ length: n }, (_, i) => bash(`c${i % 7}`)));
const history = fc.oneof(
	{ weight: 4, arbitrary: fc.array(call, { maxLength: 12 }) },
	{ weight: 1, arbitrary: longHistory },
	{ weight: 1, arbitrary: anyJson },
);
const recordedCall = fc.record(
	{
		tool: field(fc.constantFrom("bash", "t")),
		args: anyJson,
		mutates: field(fc.boolean()),
		output: field(fc.oneof(fc.string(), edgyString, hugeString)),
		exitCode: field(fc.integer()),
		execMs: field(fc.nat()),
		snapshot: field(
			fc.record({
				driver: field(fc.constantFrom("workspace", "docker")),
				key: field(fc.string({ minLength: 1 })),
				bytes: field(fc.nat()),
			}),
		),
	},
	{ requiredKeys: [] },
);
/** An object of these fields, sometimes with one the schema does not know. */
const body = (fields: Record<string, fc.Arbitrary<unknown>>) =>
	fc
		.tuple(
			fc.record(fields, { requiredKeys: [] }),
			fc.option(fc.tuple(fc.string(), anyJson), { freq: 5 }),
		)
		.map(([b, extra]) => (extra ? { ...b, [extra[0]]: extra[1] } : b));

/** Raw bytes of a body: JSON, JSON with a lone surrogate escaped in it, or not JSON. */
const rawBody = (value: fc.Arbitrary<unknown>) =>
	fc.oneof(
		{ weight: 6, arbitrary: value.map((v) => JSON.stringify(v) ?? "null") },
		{
			weight: 2,
			// `\uD800` as six characters of JSON text: valid JSON whose string
			// is not valid Unicode, which JS engines and JCS treat differently.
			arbitrary: fc
				.tuple(value, fc.constantFrom("\\ud800", "\\udfff", "\\udbff\\u0041"))
				.map(([v, esc]) => {
					const s = JSON.stringify(v) ?? "null";
					const at = s.indexOf('"');
					return at < 0
						? `"${esc}"`
						: s.slice(0, at + 1) + esc + s.slice(at + 1);
				}),
		},
		{
			weight: 1,
			arbitrary: fc.tuple(value, fc.nat()).map(([v, n]) => {
				const s = JSON.stringify(v) ?? "";
				return s.slice(0, n % (s.length + 1));
			}),
		},
		{ weight: 1, arbitrary: fc.string({ unit: "binary" }) },
	);

/** A lookup or record whose args nest up to 300,000 levels, as raw JSON text. */
const deepArgs = fc
	.tuple(
		fc.integer({ min: 1, max: 300_000 }),
		fc.boolean(),
		fc.constantFrom("lookup", "record"),
	)
	.map(([d, objects, route]) => {
		const args =
			(objects ? '{"k":'.repeat(d) : "[".repeat(d)) +
			"1" +
			(objects ? "}" : "]").repeat(d);
		const c = `{"tool":"t","args":${args}`;
		return {
			route: `${route} with args ${d} deep`,
			method: "POST",
			path: (t: string) => `/v1/tasks/${t}/${route}`,
			raw:
				route === "lookup"
					? `{"history":[],"call":${c}}}`
					: `{"from":"${ROOT_ID}","calls":[${c},"output":"","execMs":1}]}`,
		};
	});

const contentType = fc.oneof(
	{ weight: 8, arbitrary: fc.constant("application/json") },
	{
		weight: 1,
		arbitrary: fc.constantFrom(
			"text/plain",
			"application/json; charset=latin1",
			"application/x-www-form-urlencoded",
			"multipart/form-data",
		),
	},
	{ weight: 1, arbitrary: fc.constant(undefined) },
);

// -------------------------------------------------------- task routes

type Route = {
	method: string;
	path: (task: string) => string;
	body: fc.Arbitrary<string>;
};

const lease = fc.oneof(fc.uuid(), text);
const rollout = fc.oneof(fc.uuid(), text);
const taskRoutes: fc.Arbitrary<{
	route: string;
	method: string;
	path: (t: string) => string;
	raw: string;
}> = fc.oneof(
	rawBody(
		body({
			call: field(call),
			history,
			cursor: id,
			lease: field(fc.boolean()),
			leaseTtlMs: field(fc.integer()),
		}),
	).map((raw) => ({
		route: "lookup",
		method: "POST",
		path: (t: string) => `/v1/tasks/${t}/lookup`,
		raw,
	})),
	rawBody(
		body({
			from: id,
			calls: field(fc.array(recordedCall, { maxLength: 6 })),
		}),
	).map((raw) => ({
		route: "record",
		method: "POST",
		path: (t: string) => `/v1/tasks/${t}/record`,
		raw,
	})),
	rawBody(body({ state: id, ttlMs: field(fc.integer()) })).map((raw) => ({
		route: "lease",
		method: "POST",
		path: (t: string) => `/v1/tasks/${t}/leases`,
		raw,
	})),
	fc
		.tuple(lease, rawBody(body({ ttlMs: field(fc.integer()) })))
		.map(([l, raw]) => ({
			route: "renew",
			method: "POST",
			path: (t: string) => `/v1/tasks/${t}/leases/${enc(l)}/renew`,
			raw,
		})),
	lease.map((l) => ({
		route: "release",
		method: "DELETE",
		path: (t: string) => `/v1/tasks/${t}/leases/${enc(l)}`,
		raw: "",
	})),
	rawBody(
		body({
			template: field(
				fc.record(
					{
						driver: field(fc.constantFrom("workspace", "sqlite", "docker")),
						name: field(fc.string()),
						network: field(fc.boolean()),
					},
					{ requiredKeys: [] },
				),
			),
			oracle: field(fc.boolean()),
		}),
	).map((raw) => ({
		route: "open rollout",
		method: "POST",
		path: (t: string) => `/v1/tasks/${t}/rollouts`,
		raw,
	})),
	fc
		.tuple(
			rollout,
			rawBody(
				fc
					.tuple(call, field(fc.integer()))
					.map(([c, timeoutMs]) => ({ ...c, timeoutMs })),
			),
		)
		.map(([r, raw]) => ({
			route: "rollout call",
			method: "POST",
			path: (t: string) => `/v1/tasks/${t}/rollouts/${enc(r)}/calls`,
			raw,
		})),
	fc.tuple(rollout, fc.constantFrom("GET", "DELETE")).map(([r, method]) => ({
		route: "rollout",
		method,
		path: (t: string) => `/v1/tasks/${t}/rollouts/${enc(r)}`,
		raw: "",
	})),
	deepArgs,
	fc.tuple(id, fc.constantFrom("GET")).map(([r]) => ({
		route: "result",
		method: "GET",
		path: (t: string) => `/v1/tasks/${t}/results/${enc(r)}`,
		raw: "",
	})),
	fc.tuple(fc.string(), fc.string()).map(([after, limit]) => ({
		route: "graph",
		method: "GET",
		path: (t: string) =>
			`/v1/tasks/${t}/graph?after=${enc(after)}&limit=${enc(limit)}`,
		raw: "",
	})),
);

let taskSeq = 0;
/**
 * A task only rejected requests have reached. It moves on after a success,
 * so that the whole run touches few Durable Objects (every object stays in
 * the test's one isolate, and hundreds of them slow it down).
 */
let pristine = "prop-0";

describe("every task route", () => {
	it("answers a success or a JSON error, and a task that saw only errors holds nothing", async () => {
		await fc.assert(
			fc.asyncProperty(taskRoutes, contentType, async (r, type) => {
				const task = pristine;
				const path = r.path(task);
				const reply = await send(r.method, path, {
					key: main.trainer,
					body: r.raw,
					headers: type ? { "content-type": type } : {},
				});
				expectWellFormed(reply, `${r.route} ${r.raw.slice(0, 200)}`);
				if (ok(reply)) {
					pristine = `prop-${++taskSeq}`;
					return;
				}
				const stats = await send("GET", `/v1/tasks/${task}/stats`, {
					key: main.host,
				});
				const left = { status: stats.status, code: stats.body?.error?.code };
				// A dirtied task must not fail every later run (and so every
				// shrinking step) with it: the next run starts clean.
				if (stats.status !== 404) pristine = `prop-${++taskSeq}`;
				expect(
					left,
					`${r.route} ${r.raw.slice(0, 200)} left the task with ${JSON.stringify(stats.body).slice(0, 200)}`,
				).toEqual({ status: 404, code: "task_not_found" });
			}),
			{ numRuns: 120 },
		);
	});

	it("leaves a task untouched by a call to a rollout it does not have", async () => {
		const r = await send("POST", "/v1/tasks/no-rollout/rollouts/nope/calls", {
			key: main.trainer,
			json: bash("ls"),
		});
		expect(r.body.error.code).toBe("rollout_not_found");
		const stats = await send("GET", "/v1/tasks/no-rollout/stats", {
			key: main.host,
		});
		expect(stats.status).toBe(404);
	});

	it("answers a success or a JSON error for any task name in the path", async () => {
		await fc.assert(
			fc.asyncProperty(
				fc.oneof(
					text,
					fc.constantFrom(".", "..", "%2F", "a/b", "a".repeat(201)),
				),
				fc.constantFrom(
					"lookup",
					"record",
					"stats",
					"graph",
					"snapshots/" + ROOT_ID,
				),
				async (name, route) => {
					const method =
						route === "lookup" || route === "record" ? "POST" : "GET";
					const r = await send(method, `/v1/tasks/${enc(name)}/${route}`, {
						key: main.trainer,
						json:
							method === "POST"
								? route === "lookup"
									? { history: [], call: bash("x") }
									: {
											from: ROOT_ID,
											calls: [{ ...bash("x"), output: "", execMs: 1 }],
										}
								: undefined,
					});
					expectWellFormed(
						r,
						`${method} task ${JSON.stringify(name).slice(0, 80)} ${route}`,
					);
				},
			),
			{ numRuns: 60 },
		);
	});
});

// ------------------------------------------------------------ blobs

describe("snapshot uploads", () => {
	it("answer a success or a JSON error, and a refused upload leaves no blob", async () => {
		await fc.assert(
			fc.asyncProperty(
				id,
				fc.oneof(fc.constantFrom("workspace", "docker"), text),
				fc.uint8Array({ maxLength: 4096 }),
				fc.oneof(
					fc.constant(undefined),
					fc.constant("exact"),
					fc.nat({ max: 8192 }).map(String),
					fc.constantFrom(
						"-1",
						"abc",
						"1.5",
						"",
						String(LIMITS.snapshotBody + 1),
					),
				),
				async (state, driver, bytes, declared) => {
					const task = `blob-${taskSeq++}`;
					const headers: Record<string, string> = {};
					const length = declared === "exact" ? String(bytes.length) : declared;
					if (length !== undefined) headers["content-length"] = length;
					const r = await send(
						"PUT",
						`/v1/tasks/${task}/snapshots/${enc(state)}?driver=${enc(driver)}`,
						{ key: main.trainer, body: bytes, headers },
					);
					const what = `PUT ${bytes.length} bytes, content-length ${length}, driver ${JSON.stringify(driver).slice(0, 40)}`;
					expectWellFormed(r, what);
					if (!ok(r)) {
						const listed = await env.BLOBS.list({
							prefix: `snapshots/props/${task}/`,
						});
						expect(listed.objects, what).toEqual([]);
					}
				},
			),
			{ numRuns: 60 },
		);
	});

	// A body shorter or longer than its Content-Length is the client's fault:
	// 400, never a retryable 503 that a client would retry forever.
	for (const [size, length] of [
		[0, "1"],
		[8, "4"],
	] as const) {
		it(`refuses ${size} bytes sent with Content-Length ${length} with 400 and stores nothing`, async () => {
			const task = `blob-mismatch-${size}`;
			const r = await send(
				"PUT",
				`/v1/tasks/${task}/snapshots/${ROOT_ID}?driver=workspace`,
				{
					key: main.trainer,
					body: new Uint8Array(size),
					headers: { "content-length": length },
				},
			);
			expect(r.status).toBe(400);
			const listed = await env.BLOBS.list({
				prefix: `snapshots/props/${task}/`,
			});
			expect(listed.objects).toEqual([]);
		});
	}
});

// --------------------------------------------------- keys, projects, hosts

async function rows(): Promise<Record<string, number>> {
	const [k, p, h] = await env.DB.batch<{ n: number }>([
		env.DB.prepare("select count(*) as n from api_keys"),
		env.DB.prepare("select count(*) as n from projects"),
		env.DB.prepare(
			"select count(*) as n from api_keys where revoked_at is not null or expires_at is not null",
		),
	]);
	const hosts = await env.DB.prepare(
		"select count(*) as n, coalesce(sum(sandboxes), 0) as s from hosts",
	).first<{ n: number; s: number }>();
	return {
		keys: k.results[0].n,
		projects: p.results[0].n,
		retired: h.results[0].n,
		hosts: hosts!.n,
		sandboxes: hosts!.s,
	};
}

const adminRoutes = fc.oneof(
	fc
		.tuple(
			rawBody(
				body({
					role: field(fc.constantFrom("trainer", "host", "admin")),
					project: field(fc.constantFrom("props", "props-b", "nowhere")),
					name: field(text),
				}),
			),
			fc.constantFrom("admin", "root", "trainer"),
		)
		.map(([raw, who]) => ({
			route: "create key",
			method: "POST",
			path: "/v1/keys",
			raw,
			who,
		})),
	fc
		.tuple(
			fc.oneof(fc.uuid(), text, fc.constant("KEY_ID")),
			rawBody(body({ graceSeconds: field(fc.nat({ max: 100 })) })),
			fc.constantFrom("admin", "root", "trainer"),
		)
		.map(([k, raw, who]) => ({
			route: "rotate key",
			method: "POST",
			path: `/v1/keys/${enc(k)}/rotate`,
			raw,
			who,
		})),
	fc
		.tuple(
			fc.oneof(fc.uuid(), text, fc.constant("KEY_ID")),
			fc.constantFrom("admin", "trainer"),
		)
		.map(([k, who]) => ({
			route: "revoke key",
			method: "DELETE",
			path: `/v1/keys/${enc(k)}`,
			raw: "",
			who,
		})),
	fc
		.tuple(fc.oneof(fc.string(), text), fc.constantFrom("admin", "root"))
		.map(([project, who]) => ({
			route: "list keys",
			method: "GET",
			path: `/v1/keys?project=${enc(project)}`,
			raw: "",
			who,
		})),
	fc
		.tuple(
			rawBody(body({ name: field(fc.stringMatching(/^[a-z0-9-]{1,70}$/)) })),
			fc.constantFrom("root", "admin"),
		)
		.map(([raw, who]) => ({
			route: "create project",
			method: "POST",
			path: "/v1/projects",
			raw,
			who,
		})),
	rawBody(
		body({
			url: field(fc.oneof(fc.webUrl(), text)),
			capacity: field(fc.integer()),
			drivers: field(
				fc.array(fc.constantFrom("docker", "workspace", "sqlite", "x")),
			),
			name: field(text),
		}),
	).map((raw) => ({
		route: "register host",
		method: "POST",
		path: "/v1/hosts",
		raw,
		who: "host",
	})),
	fc
		.tuple(
			fc.oneof(fc.uuid(), text),
			rawBody(
				body({
					sandboxes: field(fc.integer()),
					busy: field(fc.integer()),
					pools: field(fc.dictionary(fc.string(), fc.integer())),
				}),
			),
		)
		.map(([h, raw]) => ({
			route: "heartbeat",
			method: "POST",
			path: `/v1/hosts/${enc(h)}/heartbeat`,
			raw,
			who: "host",
		})),
	fc.oneof(fc.uuid(), text).map((h) => ({
		route: "deregister host",
		method: "DELETE",
		path: `/v1/hosts/${enc(h)}`,
		raw: "",
		who: "host",
	})),
	fc.tuple(fc.string(), fc.string()).map(([after, limit]) => ({
		route: "list tasks",
		method: "GET",
		path: `/v1/tasks?after=${enc(after)}&limit=${enc(limit)}`,
		raw: "",
		who: "trainer",
	})),
);

describe("keys, projects and hosts", () => {
	it("answer a success or a JSON error, and a refusal adds, revokes or changes no row", async () => {
		await fc.assert(
			fc.asyncProperty(adminRoutes, contentType, async (r, type) => {
				const key = {
					admin: other.admin,
					root: ROOT_KEY,
					trainer: other.trainer,
					host: hostsProject.host,
				}[r.who]!;
				// A real key id of props-b sometimes, so that rotations and
				// revocations can succeed as well as fail.
				const path = r.path.replace(
					"KEY_ID",
					keyIds[taskSeq++ % keyIds.length],
				);
				const before = await rows();
				const reply = await send(r.method, path, {
					key,
					body: r.raw,
					headers: type ? { "content-type": type } : {},
				});
				const what = `${r.route} ${path.slice(0, 100)} ${r.raw.slice(0, 200)}`;
				expectWellFormed(reply, what);
				if (!ok(reply)) expect(await rows(), what).toEqual(before);
			}),
			{ numRuns: 120 },
		);
	});
});

// ---------------------------------------------- paths, methods and keys

const segment = fc.oneof(
	fc.constantFrom(
		"v1",
		"tasks",
		"keys",
		"hosts",
		"projects",
		"lookup",
		"record",
		"stats",
		"graph",
		"results",
		"leases",
		"renew",
		"rollouts",
		"calls",
		"snapshots",
		"heartbeat",
		"rotate",
		"healthz",
		ROOT_ID,
		"",
		"..",
		"%",
		"%ZZ",
		"%2F",
		"%00",
		// A lone surrogate's UTF-8 bytes: not valid UTF-8, so not decodable.
		"%ED%A0%80",
		"%FF",
	),
	fc.string().map(encodeURIComponent),
	edgyString.map(enc),
	// Raw, for the URL parser to make what it will of it.
	edgyString,
);
const randomPath = fc
	.tuple(
		fc.boolean(),
		fc.array(segment, { minLength: 0, maxLength: 6 }),
		fc.option(fc.string()),
	)
	.map(([v1, segs, q]) => {
		const p = `/${v1 ? "v1/" : ""}${segs.join("/")}`;
		return q === null ? p : `${p}?${enc(q)}=${enc(q)}`;
	});
const anyKey = () =>
	fc.constantFrom(
		undefined,
		"",
		"trk_" + "0".repeat(64),
		"Basic abc",
		ROOT_KEY,
		revoked,
		main.trainer,
		main.host,
		main.admin,
		other.trainer,
		other.admin,
	);

describe("random paths, methods and keys", () => {
	it("get a success or a JSON error, one at a time", async () => {
		await fc.assert(
			fc.asyncProperty(
				fc.constantFrom(
					"GET",
					"POST",
					"PUT",
					"DELETE",
					"PATCH",
					"HEAD",
					"OPTIONS",
				),
				randomPath,
				anyKey(),
				fc.option(rawBody(anyJson)),
				async (method, path, key, raw) => {
					const r = await send(method, path, {
						key,
						body: raw ?? undefined,
						headers: raw === null ? {} : { "content-type": "application/json" },
					});
					expectWellFormed(
						r,
						`${method} ${path} key=${key?.slice(0, 8)}`,
						method,
					);
				},
			),
			{ numRuns: 100 },
		);
	});

	it("get a success or a JSON error when many keys send at once", async () => {
		await fc.assert(
			fc.asyncProperty(
				fc.array(
					fc.tuple(
						anyKey(),
						taskRoutes,
						fc.constantFrom("busy-1", "busy-2", "busy-3"),
					),
					{ minLength: 4, maxLength: 12 },
				),
				async (batch) => {
					const replies = await Promise.all(
						batch.map(([key, r, task]) =>
							send(r.method, r.path(task), {
								key,
								body: r.raw,
								headers: { "content-type": "application/json" },
							}),
						),
					);
					for (const [i, reply] of replies.entries()) {
						expectWellFormed(
							reply,
							`${batch[i][1].route} ${batch[i][1].raw.slice(0, 200)}`,
						);
					}
				},
			),
			{ numRuns: 10 },
		);
	});
});
