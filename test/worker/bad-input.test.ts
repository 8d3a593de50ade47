/**
 * Every bad input gets its status and a JSON error code, and writes nothing
 * (invariant 6). All of these go to one task that must end up untouched.
 */
import { env } from "cloudflare:workers";
import { beforeAll, describe, expect, it } from "vitest";
import { LIMITS } from "../../core/api.ts";
import {
	ROOT_ID,
	api,
	bash,
	expectError,
	project,
	run,
	unsizedBody,
} from "./helpers.ts";

let key: string;
beforeAll(async () => {
	key = (await project("bad")).trainer;
});

const T = "/v1/tasks/untouched";
const raw = (path: string, body: string, contentType = "application/json") =>
	api("POST", path, { key, body, headers: { "content-type": contentType } });

function nested(depth: number): unknown {
	let v: unknown = 1;
	for (let i = 0; i < depth; i++) v = [v];
	return v;
}

const call = bash("ls");

/** A record of `call` whose snapshot ref names `snapshotKey`. */
const recordWithSnapshot = (snapshotKey: string) =>
	api("POST", `${T}/record`, {
		key,
		json: {
			from: ROOT_ID,
			calls: [
				{
					...run(call, "o"),
					snapshot: { driver: "workspace", key: snapshotKey, bytes: 1 },
				},
			],
		},
	});

const cases: [string, () => ReturnType<typeof api>, number, string][] = [
	["malformed JSON", () => raw(`${T}/lookup`, "{bad"), 400, "invalid_json"],
	[
		"a body that is not JSON at all",
		() => raw(`${T}/record`, "hello"),
		400,
		"invalid_json",
	],
	[
		"a lookup that does not say it is JSON",
		() =>
			raw(`${T}/lookup`, JSON.stringify({ history: [], call }), "text/plain"),
		400,
		"invalid_request",
	],
	[
		"a JSON array instead of an object",
		() => raw(`${T}/lookup`, "[]"),
		400,
		"invalid_request",
	],
	[
		"a call whose tool is a number",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { history: [], call: { tool: 7 } },
			}),
		400,
		"invalid_request",
	],
	[
		"an empty tool name",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { history: [], call: { tool: "" } },
			}),
		400,
		"invalid_request",
	],
	[
		"a lookup without a call",
		() => api("POST", `${T}/lookup`, { key, json: { history: [] } }),
		400,
		"invalid_request",
	],
	[
		"both history and cursor",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { history: [], cursor: ROOT_ID, call },
			}),
		400,
		"invalid_request",
	],
	[
		"neither history nor cursor",
		() => api("POST", `${T}/lookup`, { key, json: { call } }),
		400,
		"invalid_request",
	],
	[
		"a history that is not a list",
		() => api("POST", `${T}/lookup`, { key, json: { history: {}, call } }),
		400,
		"invalid_request",
	],
	[
		"a history longer than the limit",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { history: Array(LIMITS.maxCalls + 1).fill({ tool: "t" }), call },
			}),
		400,
		"invalid_request",
	],
	[
		"a lookup body over 1 MiB (its length stated)",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: {
					history: [],
					call: { tool: "t", args: "x".repeat(LIMITS.lookupBody) },
				},
			}),
		413,
		"too_large",
	],
	[
		"a lookup body over 1 MiB streamed without a length",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				body: unsizedBody(
					JSON.stringify({
						history: [],
						call: { tool: "t", args: "x".repeat(LIMITS.lookupBody) },
					}),
				),
				headers: { "content-type": "application/json" },
			}),
		413,
		"too_large",
	],
	[
		"args nested deeper than the limit",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: {
					history: [],
					call: { tool: "t", args: nested(LIMITS.maxArgsDepth + 2) },
				},
			}),
		400,
		"invalid_request",
	],
	[
		"a lone surrogate in args",
		() =>
			raw(`${T}/lookup`, '{"history":[],"call":{"tool":"t","args":"\\ud800"}}'),
		400,
		"invalid_request",
	],
	[
		"a lone surrogate in an args key",
		() =>
			raw(
				`${T}/lookup`,
				'{"history":[],"call":{"tool":"t","args":{"\\udfff":1}}}',
			),
		400,
		"invalid_request",
	],
	// JSON.parse reads 1e400 as Infinity, which has no JSON form to hash.
	[
		"a number out of range in a lookup's args",
		() => raw(`${T}/lookup`, '{"history":[],"call":{"tool":"t","args":1e400}}'),
		400,
		"invalid_request",
	],
	[
		"a number out of range deep in a history call's args",
		() =>
			raw(
				`${T}/lookup`,
				'{"history":[{"tool":"t","args":{"a":[1,-1e400]}}],"call":{"tool":"t"}}',
			),
		400,
		"invalid_request",
	],
	[
		"a number out of range in a record's args",
		() =>
			raw(
				`${T}/record`,
				`{"from":"${ROOT_ID}","calls":[{"tool":"t","args":{"n":1e400},"output":"o","execMs":1}]}`,
			),
		400,
		"invalid_request",
	],
	[
		"a number out of range in a rollout call's args",
		() => raw(`${T}/rollouts/nope/calls`, '{"tool":"t","args":[1e999]}'),
		400,
		"invalid_request",
	],
	// A typo must not turn a read into a state-changing call.
	[
		"an unknown field in a lookup's call",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { history: [], call: { tool: "cat", mutate: false } },
			}),
		400,
		"invalid_request",
	],
	[
		"an unknown field in a history call",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { history: [{ tool: "cat", mutate: false }], call },
			}),
		400,
		"invalid_request",
	],
	[
		"an unknown field",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { history: [], call, extra: 1 },
			}),
		400,
		"invalid_request",
	],
	[
		"a cursor that is not an id",
		() => api("POST", `${T}/lookup`, { key, json: { cursor: "ABC", call } }),
		400,
		"invalid_request",
	],
	[
		"a zero lease time",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { history: [], call, leaseTtlMs: 0 },
			}),
		400,
		"invalid_request",
	],
	[
		"a stale cursor",
		() =>
			api("POST", `${T}/lookup`, {
				key,
				json: { cursor: "a".repeat(64), call },
			}),
		409,
		"stale_cursor",
	],
	[
		"a task name with a space",
		() =>
			api("POST", "/v1/tasks/a%20b/lookup", {
				key,
				json: { history: [], call },
			}),
		400,
		"invalid_request",
	],
	[
		"a task name over 200 characters",
		() =>
			api("POST", `/v1/tasks/${"a".repeat(201)}/lookup`, {
				key,
				json: { history: [], call },
			}),
		400,
		"invalid_request",
	],
	[
		"a record with no calls",
		() =>
			api("POST", `${T}/record`, { key, json: { from: ROOT_ID, calls: [] } }),
		400,
		"invalid_request",
	],
	[
		"a record without outputs",
		() =>
			api("POST", `${T}/record`, {
				key,
				json: { from: ROOT_ID, calls: [{ ...call, execMs: 1 }] },
			}),
		400,
		"invalid_request",
	],
	[
		"a negative exec time",
		() =>
			api("POST", `${T}/record`, {
				key,
				json: { from: ROOT_ID, calls: [run(call, "o", -1)] },
			}),
		400,
		"invalid_request",
	],
	[
		"a fractional exit code",
		() =>
			api("POST", `${T}/record`, {
				key,
				json: { from: ROOT_ID, calls: [run(call, "o", 1, 0.5)] },
			}),
		400,
		"invalid_request",
	],
	[
		"a snapshot on a stateless call",
		() =>
			api("POST", `${T}/record`, {
				key,
				json: {
					from: ROOT_ID,
					calls: [
						{
							...run(bash("cat", false), "o"),
							snapshot: { driver: "d", key: "k", bytes: 1 },
						},
					],
				},
			}),
		400,
		"invalid_request",
	],
	[
		"a snapshot ref to another project's blob",
		() => recordWithSnapshot("snapshots/other/untouched/x"),
		400,
		"invalid_snapshot",
	],
	[
		"a snapshot ref to an output blob",
		() => recordWithSnapshot("outputs/bad/untouched/x"),
		400,
		"invalid_snapshot",
	],
	[
		"a snapshot ref to a blob of another state of the task",
		() => recordWithSnapshot(`snapshots/bad/untouched/${"b".repeat(64)}/x`),
		400,
		"invalid_snapshot",
	],
	[
		"a record from an unknown state",
		() =>
			api("POST", `${T}/record`, {
				key,
				json: { from: "b".repeat(64), calls: [run(call, "o")] },
			}),
		409,
		"unknown_state",
	],
	[
		"an output over the configured maximum",
		() =>
			api("POST", `${T}/record`, {
				key,
				json: {
					from: ROOT_ID,
					calls: [
						run(bash("a"), "ok"),
						run(call, "x".repeat(Number(env.OUTPUT_MAX_BYTES) + 1)),
					],
				},
			}),
		413,
		"output_too_large",
	],
	[
		"a record body over 32 MiB",
		() =>
			api("POST", `${T}/record`, {
				key,
				json: {
					from: ROOT_ID,
					calls: [run(call, "x".repeat(LIMITS.recordBody))],
				},
			}),
		413,
		"too_large",
	],
	[
		"renewing a lease that never was",
		() => api("POST", `${T}/leases/nope/renew`, { key, json: {} }),
		404,
		"lease_not_found",
	],
	[
		"a lease on a malformed state",
		() => api("POST", `${T}/leases`, { key, json: { state: 1 } }),
		400,
		"invalid_request",
	],
	[
		"a graph page size over the limit",
		() => api("GET", `${T}/graph?limit=100000`, { key }),
		400,
		"invalid_request",
	],
	[
		"an eviction log page size of 0",
		() => api("GET", `${T}/evictions?limit=0`, { key }),
		400,
		"invalid_request",
	],
	[
		"an eviction log page size over the limit",
		() => api("GET", `${T}/evictions?limit=1001`, { key }),
		400,
		"invalid_request",
	],
	[
		"an eviction log position that is negative",
		() => api("GET", `${T}/evictions?after=-1`, { key }),
		400,
		"invalid_request",
	],
	[
		"an eviction log position that is no number",
		() => api("GET", `${T}/evictions?after=first`, { key }),
		400,
		"invalid_request",
	],
	[
		"a snapshot upload without a driver",
		() => api("PUT", `${T}/snapshots/${ROOT_ID}`, { key, body: "abc" }),
		400,
		"invalid_request",
	],
	[
		"a snapshot for a malformed state",
		() =>
			api("PUT", `${T}/snapshots/xyz?driver=workspace`, { key, body: "abc" }),
		400,
		"invalid_request",
	],
	[
		"a route that does not exist",
		() => api("GET", "/v1/nothing", { key }),
		404,
		"not_found",
	],
];

describe("bad input", () => {
	it.each(cases)(
		"answers %s with its status and code",
		async (_name, send, status, code) => {
			expectError(await send(), status, code);
		},
	);

	it("leaves the task untouched after all of them", async () => {
		for (const [, send] of cases) await send();
		expectError(await api("GET", `${T}/stats`, { key }), 404, "task_not_found");
		expect(
			(await env.BLOBS.list({ prefix: "outputs/bad/" })).objects,
		).toHaveLength(0);
		expect(
			(await env.BLOBS.list({ prefix: "snapshots/bad/" })).objects,
		).toHaveLength(0);
		const row = await env.DB.prepare(
			"select 1 from tasks where project_id = 'bad'",
		).first();
		expect(row).toBeNull();
	});
});
