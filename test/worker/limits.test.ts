/// <reference types="vite/client" />
/**
 * Abuse and overload (issue 4: per-key rate limits, fault 8). These tests run
 * the Worker's own fetch handler with one binding swapped:
 *
 * - RATE_LIMITER by TEST_RATE_LIMITER, a real (miniflare) rate limiter with a
 *   limit of 3 per 10 s from vitest.config.ts, so that no other test file
 *   ever meets a limit;
 * - TASK_GRAPH by a namespace whose stub for one task throws what the
 *   Durable Object runtime throws when that object is overloaded. The real
 *   runtime cannot be pushed into that state locally; this double is used
 *   here only.
 */
import { env } from "cloudflare:workers";
import { beforeAll, describe, expect, it } from "vitest";
import { RATE_LIMIT_PERIOD_SECONDS } from "../../functions/limits.ts";
import {
	OVERLOADED_RETRY_AFTER_SECONDS,
	UNAVAILABLE_RETRY_AFTER_SECONDS,
} from "../../functions/errors.ts";
import wranglerToml from "../../wrangler.toml?raw";
import {
	ROOT_ID,
	ROOT_KEY,
	api,
	bash,
	expectError,
	project,
	run,
	taskApi,
	type Reply,
} from "./helpers.ts";

const TEST_LIMIT = 3;

/** Sends a request to the Worker's fetch handler under `bindings`. */
const send = (
	bindings: Env,
	method: string,
	path: string,
	opts: { key?: string; json?: unknown } = {},
): Promise<Reply> => api(method, path, { ...opts, env: bindings });

const limited: Env = {
	...env,
	RATE_LIMITER: (env as unknown as { TEST_RATE_LIMITER: RateLimit })
		.TEST_RATE_LIMITER,
};

let p: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	p = await project("limits");
});

const record = (i: number, prefix: string) => ({
	path: `/v1/tasks/${prefix}-${i}/record`,
	json: { from: ROOT_ID, calls: [run(bash(`step ${i}`), `out ${i}`)] },
});

function expectLimited(r: Reply): void {
	expectError(r, 429, "rate_limited");
	expect(r.headers.get("retry-after")).toBe(String(RATE_LIMIT_PERIOD_SECONDS));
}

describe("per-key rate limits", () => {
	it("refuses a key past its limit with 429 and Retry-After, writes nothing for it, and leaves another key alone", async () => {
		// 2 × limit + 1 requests in well under one period span at most two of
		// the limiter's windows, so at least one window sees more than the
		// limit whichever instant the test starts at.
		const replies: Reply[] = [];
		for (let i = 0; i < 2 * TEST_LIMIT + 1; i++) {
			const r = record(i, "flood");
			replies.push(
				await send(limited, "POST", r.path, { key: p.trainer, ...r }),
			);
		}
		const refused = replies.flatMap((r, i) => (r.status === 429 ? [i] : []));
		expect(refused.length).toBeGreaterThanOrEqual(1);
		expect(refused.length).toBeLessThanOrEqual(TEST_LIMIT + 1);
		for (const [i, r] of replies.entries()) {
			if (refused.includes(i)) expectLimited(r);
			else expect(r.status).toBe(200);
		}

		// Another key of the same project, right after a refusal.
		const other = await send(limited, "POST", record(0, "other").path, {
			key: p.admin,
			json: record(0, "other").json,
		});
		expect(other.status).toBe(200);

		// A refused record left no task behind; an accepted one did.
		for (let i = 0; i < replies.length; i++) {
			const stats = await taskApi(p.host, `flood-${i}`).stats();
			if (refused.includes(i)) expectError(stats, 404, "task_not_found");
			else expect(stats.body).toMatchObject({ nodes: 2 });
		}
	});

	it("limits the root admin key too, and a refused request creates no project", async () => {
		const names = Array.from(
			{ length: 2 * TEST_LIMIT + 1 },
			(_, i) => `lim-root-${i}`,
		);
		const statuses: number[] = [];
		for (const name of names) {
			const r = await send(limited, "POST", "/v1/projects", {
				key: ROOT_KEY,
				json: { name },
			});
			if (r.status === 429) expectLimited(r);
			statuses.push(r.status);
		}
		expect(statuses).toContain(429);
		const { results } = await env.DB.prepare(
			"select id from projects where id like 'lim-root-%' order by id",
		).all<{ id: string }>();
		expect(results.map((r) => r.id)).toEqual(
			names.filter((_, i) => statuses[i] === 201),
		);
	});

	it("does not count requests without a valid key: they get 401, never 429", async () => {
		for (let i = 0; i < 2 * TEST_LIMIT + 1; i++) {
			expectError(
				await send(limited, "GET", "/v1/tasks", { key: `trk_nobody${i}` }),
				401,
				"unauthorized",
			);
		}
	});

	it("says in Retry-After the period the binding is configured with", () => {
		const block = /\[\[ratelimits\]\][^[]*?name = "RATE_LIMITER"[^[]*/.exec(
			wranglerToml,
		);
		expect(block?.[0]).toMatch(
			new RegExp(`period = ${RATE_LIMIT_PERIOD_SECONDS}\\b`),
		);
	});
});

/** A TASK_GRAPH whose object for `sick` throws `error` from every method. */
function failingGraph(sick: string, error: Error): Env["TASK_GRAPH"] {
	const real = env.TASK_GRAPH;
	const sickId = real.idFromName(sick);
	const broken = new Proxy(
		{},
		{
			get: (_, prop) =>
				// Not a thenable: the stub itself is never awaited.
				prop === "then"
					? undefined
					: async () => {
							throw error;
						},
		},
	);
	return new Proxy(real, {
		get: (target, prop) =>
			prop === "get"
				? (id: DurableObjectId) => (id.equals(sickId) ? broken : target.get(id))
				: Reflect.get(target, prop).bind(target),
	});
}

const withGraph = (graph: Env["TASK_GRAPH"]): Env => ({
	...env,
	TASK_GRAPH: graph,
});

/** What the runtime throws; `overloaded`/`retryable` are its own flags. */
function runtimeError(message: string, flags: object): Error {
	return Object.assign(new Error(message), flags);
}

describe("an overloaded task graph", () => {
	it("answers 503 overloaded with Retry-After for that task, and other tasks keep working", async () => {
		const bindings = withGraph(
			failingGraph(
				"limits/hot",
				runtimeError(
					"Durable Object is overloaded. Too many requests queued.",
					{
						overloaded: true,
						retryable: false,
					},
				),
			),
		);
		const hot = [
			await send(bindings, "POST", "/v1/tasks/hot/lookup", {
				key: p.trainer,
				json: { history: [], call: bash("x") },
			}),
			await send(bindings, "POST", "/v1/tasks/hot/record", {
				key: p.trainer,
				json: { from: ROOT_ID, calls: [run(bash("x"), "y")] },
			}),
			await send(bindings, "GET", "/v1/tasks/hot/stats", { key: p.trainer }),
		];
		for (const r of hot) {
			expectError(r, 503, "overloaded");
			expect(r.headers.get("retry-after")).toBe(
				String(OVERLOADED_RETRY_AFTER_SECONDS),
			);
		}

		const cool = await send(bindings, "POST", "/v1/tasks/cool/record", {
			key: p.trainer,
			json: { from: ROOT_ID, calls: [run(bash("x"), "y")] },
		});
		expect(cool.status).toBe(200);
		const hit = await send(bindings, "POST", "/v1/tasks/cool/lookup", {
			key: p.trainer,
			json: { history: [], call: bash("x") },
		});
		expect(hit.body).toMatchObject({ status: "hit", output: "y" });
	});

	it("answers 503 unavailable with Retry-After for a transient (retryable) error", async () => {
		const bindings = withGraph(
			failingGraph(
				"limits/moving",
				runtimeError("Durable Object reset because its code was updated.", {
					retryable: true,
				}),
			),
		);
		const r = await send(bindings, "POST", "/v1/tasks/moving/lookup", {
			key: p.trainer,
			json: { history: [], call: bash("x") },
		});
		expectError(r, 503, "unavailable");
		expect(r.headers.get("retry-after")).toBe(
			String(UNAVAILABLE_RETRY_AFTER_SECONDS),
		);
	});

	it("still answers 500 for an error the runtime did not flag", async () => {
		const bindings = withGraph(
			failingGraph("limits/buggy", new TypeError("a bug in the object")),
		);
		const r = await send(bindings, "GET", "/v1/tasks/buggy/stats", {
			key: p.trainer,
		});
		expectError(r, 500, "internal");
		expect(r.headers.get("retry-after")).toBeNull();
	});
});

// The app behind `api()` must carry the limiter for every request, not only
// the handler the tests above swap bindings into: the configured binding,
// watched, has to see each request under its key, and a normal pace passes.
it("counts every request against the configured limiter under its key, and lets a normal pace through", async () => {
	const seen: string[] = [];
	const real = env.RATE_LIMITER;
	const watched: Env = {
		...env,
		RATE_LIMITER: {
			limit: (options: RateLimitOptions) => {
				seen.push(options.key);
				return real.limit(options);
			},
		} as RateLimit,
	};
	const keys = await api("GET", "/v1/keys", { key: p.admin });
	const hostKey = keys.body.keys.find(
		(k: { role: string }) => k.role === "host",
	);
	for (let i = 0; i < 2 * TEST_LIMIT + 1; i++) {
		const r = await api("GET", "/v1/tasks", { key: p.host, env: watched });
		expect(r.status).toBe(200);
	}
	expect(seen).toEqual(Array(2 * TEST_LIMIT + 1).fill(`key:${hostKey.id}`));
});
