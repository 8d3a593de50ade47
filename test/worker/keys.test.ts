/**
 * Key rotation (issue 4, "Keys can be revoked and rotated"): a new key of the
 * same project, role and name; the old one dies at once or after its grace,
 * in the clock the Worker reads (advanced here, never slept through).
 */
import { beforeAll, describe, expect, it } from "vitest";
import { advanceClock } from "../../core/clock.ts";
import { KEY_CACHE_MS } from "../../functions/auth.ts";
import { ROOT_KEY, api, expectError, project } from "./helpers.ts";

let a: Awaited<ReturnType<typeof project>>;
let b: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	a = await project("rot-a");
	b = await project("rot-b");
});

/** A fresh key in project `a`, named, with its id. */
async function fresh(name: string, role = "trainer") {
	const r = await api("POST", "/v1/keys", {
		key: a.admin,
		json: { role, name },
	});
	expect(r.status).toBe(201);
	return r.body as { id: string; key: string };
}

const rotate = (id: string, json?: unknown, key = a.admin) =>
	api("POST", `/v1/keys/${id}/rotate`, { key, json });

/** The status a key gets on a route every role may use. */
const statusOf = async (key: string) =>
	(await api("GET", "/v1/hosts", { key })).status;

async function listed(id: string) {
	const r = await api("GET", "/v1/keys", { key: a.admin });
	return r.body.keys.find((k: { id: string }) => k.id === id);
}

describe("key rotation", () => {
	it("issues a new key of the same project, role and name, and revokes the old one at once by default", async () => {
		const old = await fresh("ci", "host");
		// Used once, so this isolate holds it as verified.
		expect(await statusOf(old.key)).toBe(200);

		const r = await rotate(old.id, {});
		expect(r.status).toBe(201);
		expect(r.body).toMatchObject({
			project: "rot-a",
			role: "host",
			name: "ci",
		});
		expect(r.body.id).not.toBe(old.id);
		expect(r.body.key).toMatch(/^trk_[0-9a-f]{64}$/);
		expect(r.body.key).not.toBe(old.key);

		expectError(
			await api("GET", "/v1/hosts", { key: old.key }),
			401,
			"unauthorized",
		);
		expect(await statusOf(r.body.key)).toBe(200);
		expect((await listed(old.id)).revokedAt).toEqual(expect.any(Number));
		expect(await listed(r.body.id)).toMatchObject({
			role: "host",
			name: "ci",
			revokedAt: null,
			expiresAt: null,
		});
	});

	it("accepts a rotation with no body at all", async () => {
		const old = await fresh("no-body");
		const r = await rotate(old.id);
		expect(r.status).toBe(201);
		expect(await statusOf(old.key)).toBe(401);
	});

	it("keeps the old key working through its grace and refuses it right after", async () => {
		const old = await fresh("graceful");
		const r = await rotate(old.id, { graceSeconds: 60 });
		expect(r.status).toBe(201);
		expect(await statusOf(old.key)).toBe(200);
		expect(await statusOf(r.body.key)).toBe(200);
		expect((await listed(old.id)).revokedAt).toBeNull();

		advanceClock(59_000);
		expect(await statusOf(old.key)).toBe(200);
		advanceClock(1_000);
		expect(await statusOf(old.key)).toBe(401);
		expect(await statusOf(r.body.key)).toBe(200);
	});

	it("ends a grace shorter than the key cache exactly, though the key was just verified", async () => {
		const old = await fresh("short-grace");
		const r = await rotate(old.id, { graceSeconds: 1 });
		expect(r.status).toBe(201);
		// Verified and remembered now; the memory must not outlive the grace.
		expect(await statusOf(old.key)).toBe(200);
		expect(1_000).toBeLessThan(KEY_CACHE_MS);
		advanceClock(1_000);
		expect(await statusOf(old.key)).toBe(401);
	});

	it("lets a second rotation shorten a grace but never lengthen it", async () => {
		const old = await fresh("twice");
		expect((await rotate(old.id, { graceSeconds: 10 })).status).toBe(201);
		const until = (await listed(old.id)).expiresAt;
		expect((await rotate(old.id, { graceSeconds: 3600 })).status).toBe(201);
		expect((await listed(old.id)).expiresAt).toBe(until);
		expect((await rotate(old.id, { graceSeconds: 0 })).status).toBe(201);
		expect(await statusOf(old.key)).toBe(401);
	});

	it("lets the root key rotate any project's key, and a key rotate itself", async () => {
		const old = await fresh("by-root");
		const r = await rotate(old.id, {}, ROOT_KEY);
		expect(r.status).toBe(201);
		expect(r.body.project).toBe("rot-a");

		const admin = await fresh("self", "admin");
		const self = await rotate(admin.id, {}, admin.key);
		expect(self.status).toBe(201);
		expect(await statusOf(admin.key)).toBe(401);
		expect(await statusOf(self.body.key)).toBe(200);
	});

	it("refuses to rotate a revoked key with 409 and makes no key", async () => {
		const old = await fresh("dead");
		await api("DELETE", `/v1/keys/${old.id}`, { key: a.admin });
		const before = (await api("GET", "/v1/keys", { key: a.admin })).body.keys
			.length;
		expectError(await rotate(old.id, {}), 409, "key_revoked");
		const after = (await api("GET", "/v1/keys", { key: a.admin })).body.keys
			.length;
		expect(after).toBe(before);
	});

	it("answers 404 for another project's key id and for an unknown id", async () => {
		const theirs = (await api("GET", "/v1/keys", { key: b.admin })).body.keys[0]
			.id as string;
		expectError(await rotate(theirs, {}), 404, "key_not_found");
		expectError(
			await rotate("00000000-0000-0000-0000-000000000000", {}, ROOT_KEY),
			404,
			"key_not_found",
		);
		// Their key was left alone.
		expect(await statusOf(b.trainer)).toBe(200);
	});

	it("keeps trainer and host keys from rotating anything", async () => {
		const old = await fresh("kept");
		expectError(await rotate(old.id, {}, a.trainer), 403, "forbidden");
		expectError(await rotate(old.id, {}, a.host), 403, "forbidden");
		expect(await statusOf(old.key)).toBe(200);
	});

	it("refuses bad bodies with 400 and leaves the key as it was", async () => {
		const old = await fresh("bad-bodies");
		const bad: [unknown, string][] = [
			[{ graceSeconds: -1 }, "invalid_request"],
			[{ graceSeconds: 1.5 }, "invalid_request"],
			[{ graceSeconds: "60" }, "invalid_request"],
			[{ graceSeconds: 1e12 }, "invalid_request"],
			[{ graceSeconds: null }, "invalid_request"],
			[{ grace: 60 }, "invalid_request"],
			[[], "invalid_request"],
			["60", "invalid_request"],
		];
		for (const [json, code] of bad) {
			expectError(await rotate(old.id, json), 400, code);
		}
		expectError(
			await api("POST", `/v1/keys/${old.id}/rotate`, {
				key: a.admin,
				body: "{grace",
				headers: { "content-type": "application/json" },
			}),
			400,
			"invalid_json",
		);
		expect(await statusOf(old.key)).toBe(200);
		const entry = await listed(old.id);
		expect(entry).toMatchObject({ revokedAt: null, expiresAt: null });
		const names = (await api("GET", "/v1/keys", { key: a.admin })).body.keys
			.map((k: { name: string }) => k.name)
			.filter((n: string) => n === "bad-bodies");
		expect(names).toHaveLength(1);
	});
});
