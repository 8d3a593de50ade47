import { env } from "cloudflare:workers";
import { beforeAll, describe, expect, it } from "vitest";
import { rememberedTokens } from "../../functions/auth.ts";
import {
	ROOT_ID,
	ROOT_KEY,
	api,
	bash,
	expectError,
	project,
	run,
	taskApi,
} from "./helpers.ts";

let a: Awaited<ReturnType<typeof project>>;
let b: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	a = await project("alpha");
	b = await project("beta");
	await taskApi(a.trainer, "shared-name").record({
		from: ROOT_ID,
		calls: [run(bash("secret"), "alpha's output")],
	});
});

describe("authentication", () => {
	it("answers 401 without a key, with a malformed header, and with an unknown key", async () => {
		const path = "/v1/tasks/shared-name/stats";
		expectError(await api("GET", path), 401, "unauthorized");
		expectError(
			await api("GET", path, { headers: { authorization: "Basic abc" } }),
			401,
			"unauthorized",
		);
		const wrong = await api("GET", path, { key: "trk_" + "0".repeat(64) });
		expectError(wrong, 401, "unauthorized");
		expect(wrong.headers.get("www-authenticate")).toMatch(/Bearer/);
	});

	// A review found the Worker remembering every bearer string it saw, of
	// any length, before checking it: unauthenticated requests with large
	// random tokens could fill an isolate's memory.
	it("refuses malformed and overlong tokens with 401 before asking D1, and remembers none of them", async () => {
		let asked = 0;
		const counted: Env = {
			...env,
			DB: new Proxy(env.DB, {
				get(target, prop) {
					const v = Reflect.get(target, prop);
					if (typeof v !== "function") return v;
					return (...args: unknown[]) => {
						asked++;
						return v.apply(target, args);
					};
				},
			}),
		};
		const random = (n: number) => {
			const b = new Uint8Array(Math.ceil(n / 2));
			crypto.getRandomValues(b);
			return Buffer.from(b).toString("hex").slice(0, n);
		};
		const before = rememberedTokens();
		const tokens = [
			random(32 << 10),
			"trk_" + random(32 << 10),
			"trk_" + random(63),
			"trk_" +
				random(64)
					.toUpperCase()
					.replace(/^[0-9]/, "A"),
			"sk-" + random(40),
			ROOT_KEY + "x",
		];
		for (const token of tokens) {
			const r = await api("GET", "/v1/tasks", { key: token, env: counted });
			expectError(r, 401, "unauthorized");
			expect(r.headers.get("www-authenticate")).toMatch(/invalid_token/);
		}
		expect(asked).toBe(0);
		expect(rememberedTokens()).toBe(before);
		// Well-formed keys still go through: a real one, and the root key.
		expect(
			(await api("GET", "/v1/tasks", { key: a.trainer, env: counted })).status,
		).toBe(200);
		expect(
			(
				await api("GET", "/v1/keys?project=alpha", {
					key: ROOT_KEY,
					env: counted,
				})
			).status,
		).toBe(200);
	});

	it("answers the deep health probe for any key, and only with one", async () => {
		expectError(await api("GET", "/v1/health"), 401, "unauthorized");
		for (const key of [ROOT_KEY, a.trainer, a.host, a.admin]) {
			expect(await api("GET", "/v1/health", { key })).toMatchObject({
				status: 200,
				body: { ok: true },
			});
		}
	});

	it("serves the health probe without a key", async () => {
		const r = await api("GET", "/healthz");
		expect(r).toMatchObject({ status: 200, body: "ok" });
	});
});

describe("isolation between projects", () => {
	it("never shows one project's task to another project's key, even under the same task name", async () => {
		const mine = taskApi(a.trainer, "shared-name");
		const theirs = taskApi(b.trainer, "shared-name");
		expect(
			(await mine.lookup({ history: [], call: bash("secret") })).body,
		).toMatchObject({
			status: "hit",
			output: "alpha's output",
		});
		expect(
			(await theirs.lookup({ history: [], call: bash("secret") })).body.status,
		).toBe("miss");
		// Beta's task of the same name is its own: only its one lookup, only the root node.
		expect((await theirs.stats()).body).toMatchObject({
			lookups: 1,
			hits: 0,
			nodes: 1,
		});
		const rec = await mine.record({
			from: ROOT_ID,
			calls: [run(bash("secret"), "alpha's output")],
		});
		expectError(await theirs.result(rec.body.state), 404, "not_found");
		const list = await api("GET", "/v1/tasks", { key: b.trainer });
		expect(list.body.tasks.map((t: { task: string }) => t.task)).not.toContain(
			"shared-name",
		);
	});

	it("does not let a project admin make keys for another project or revoke its keys", async () => {
		const cross = await api("POST", "/v1/keys", {
			key: a.admin,
			json: { role: "trainer", project: "beta" },
		});
		expectError(cross, 403, "forbidden");
		const theirKeys = await api("GET", "/v1/keys?project=beta", {
			key: b.admin,
		});
		const theirKeyId = theirKeys.body.keys[0].id;
		expectError(
			await api("DELETE", `/v1/keys/${theirKeyId}`, { key: a.admin }),
			404,
			"key_not_found",
		);
		expectError(
			await api("GET", "/v1/keys?project=beta", { key: a.admin }),
			403,
			"forbidden",
		);
	});
});

describe("roles", () => {
	it("keeps host keys to snapshot blobs and trainer keys away from keys", async () => {
		const host = taskApi(a.host, "roles");
		expectError(
			await host.lookup({ history: [], call: bash("x") }),
			403,
			"forbidden",
		);
		expectError(
			await host.record({ from: ROOT_ID, calls: [run(bash("x"), "y")] }),
			403,
			"forbidden",
		);
		expectError(
			await api("POST", "/v1/keys", {
				key: a.trainer,
				json: { role: "admin" },
			}),
			403,
			"forbidden",
		);
		expectError(
			await api("POST", "/v1/projects", {
				key: a.admin,
				json: { name: "gamma" },
			}),
			403,
			"forbidden",
		);
	});

	it("keeps the root admin key out of tasks", async () => {
		expectError(
			await taskApi(ROOT_KEY, "roles").lookup({ history: [], call: bash("x") }),
			403,
			"forbidden",
		);
	});

	it("lets a project admin make, list and revoke keys, and a revoked key stops working", async () => {
		const made = await api("POST", "/v1/keys", {
			key: a.admin,
			json: { role: "trainer", name: "ci" },
		});
		expect(made.status).toBe(201);
		expect(made.body).toMatchObject({
			project: "alpha",
			role: "trainer",
			name: "ci",
		});
		expect(made.body.key).toMatch(/^trk_[0-9a-f]{64}$/);
		const t = taskApi(made.body.key, "revoked");
		expect((await t.lookup({ history: [], call: bash("x") })).status).toBe(200);

		const listed = await api("GET", "/v1/keys", { key: a.admin });
		const entry = listed.body.keys.find(
			(k: { id: string }) => k.id === made.body.id,
		);
		expect(entry).toMatchObject({ role: "trainer", revokedAt: null });
		expect(JSON.stringify(listed.body)).not.toContain(made.body.key);

		expect(
			(await api("DELETE", `/v1/keys/${made.body.id}`, { key: a.admin })).body,
		).toEqual({
			id: made.body.id,
			revoked: true,
		});
		expectError(
			await t.lookup({ history: [], call: bash("x") }),
			401,
			"unauthorized",
		);
	});
});

describe("projects", () => {
	it("creates a project once; the second time is 409", async () => {
		expect(
			(
				await api("POST", "/v1/projects", {
					key: ROOT_KEY,
					json: { name: "delta" },
				})
			).status,
		).toBe(201);
		expectError(
			await api("POST", "/v1/projects", {
				key: ROOT_KEY,
				json: { name: "delta" },
			}),
			409,
			"project_exists",
		);
	});

	it("refuses a key for a project that does not exist with 404", async () => {
		const r = await api("POST", "/v1/keys", {
			key: ROOT_KEY,
			json: { role: "trainer", project: "nowhere" },
		});
		expectError(r, 404, "project_not_found");
	});
});
