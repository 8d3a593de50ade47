import { env } from "cloudflare:workers";
import { beforeAll, describe, expect, it } from "vitest";
import {
	ROOT_ID,
	api,
	bash,
	expectError,
	project,
	run,
	taskApi,
} from "./helpers.ts";

let keys: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	keys = await project("snaps");
});

const bytes = (n: number) =>
	Uint8Array.from({ length: n }, (_, i) => (i * 31 + 7) & 0xff);

describe("snapshot blobs", () => {
	it("streams a blob into R2 and back, byte for byte, and a record points the node at it", async () => {
		const t = taskApi(keys.trainer, "roundtrip");
		const rec = await t.record({
			from: ROOT_ID,
			calls: [run(bash("build"), "built")],
		});
		const state = rec.body.state;
		const blob = bytes(300_000);
		const up = await api(
			"PUT",
			`/v1/tasks/roundtrip/snapshots/${state}?driver=workspace`,
			{
				key: keys.host,
				body: blob,
			},
		);
		expect(up.status).toBe(201);
		expect(up.body).toEqual({
			driver: "workspace",
			key: expect.stringMatching(
				new RegExp(`^snapshots/snaps/roundtrip/${state}/[0-9a-f-]{36}$`),
			),
			bytes: blob.length,
		});

		const res = await (
			await import("cloudflare:workers")
		).exports.default.fetch(
			new Request(
				`https://trellis.test/v1/tasks/roundtrip/snapshots/${state}`,
				{
					headers: { authorization: `Bearer ${keys.trainer}` },
				},
			),
		);
		expect(res.status).toBe(200);
		expect(res.headers.get("x-trellis-driver")).toBe("workspace");
		expect(new Uint8Array(await res.arrayBuffer())).toEqual(blob);

		// Point the node at it (a record of the same call adds the snapshot).
		const again = await t.record({
			from: ROOT_ID,
			calls: [{ ...run(bash("build"), "built"), snapshot: up.body }],
		});
		expect(again.body.results[0].status).toBe("exists");
		const miss = await t.lookup({
			history: [bash("build")],
			call: bash("test"),
		});
		expect(miss.body.snapshot).toEqual({ ...up.body, state, depth: 1 });
		expect((await t.stats()).body).toMatchObject({
			snapshots: 1,
			snapshotBytes: blob.length,
		});
	});

	it("answers 404 for a state with no blob", async () => {
		const r = await api(
			"GET",
			`/v1/tasks/roundtrip/snapshots/${"c".repeat(64)}`,
			{ key: keys.trainer },
		);
		expectError(r, 404, "snapshot_not_found");
	});

	it("keeps blobs per project: another project's key cannot read one", async () => {
		const other = await project("snaps-other");
		const state = "d".repeat(64);
		const up = await api(
			"PUT",
			`/v1/tasks/iso/snapshots/${state}?driver=workspace`,
			{
				key: keys.host,
				body: bytes(10),
			},
		);
		expectError(
			await api("GET", `/v1/tasks/iso/snapshots/${state}`, { key: other.host }),
			404,
			"snapshot_not_found",
		);
		expect(await env.BLOBS.head(up.body.key)).not.toBeNull();
	});

	// Found by the soak benchmark: with one key per state, an eviction deleting
	// a state's old blob removed a new one recorded for it meanwhile.
	it("gives every upload its own key, so deleting an old blob never takes a newer one", async () => {
		const t = taskApi(keys.trainer, "reupload");
		const rec = await t.record({
			from: ROOT_ID,
			calls: [run(bash("build"), "built")],
		});
		const state = rec.body.state;
		const put = (b: Uint8Array) =>
			api("PUT", `/v1/tasks/reupload/snapshots/${state}?driver=workspace`, {
				key: keys.host,
				body: b,
			});
		const first = await put(bytes(5));
		const second = await put(bytes(7));
		expect(first.body.key).not.toBe(second.body.key);
		await t.record({
			from: ROOT_ID,
			calls: [{ ...run(bash("build"), "built"), snapshot: second.body }],
		});
		// Deleting the first (an eviction's late delete, say) leaves the recorded one.
		await env.BLOBS.delete(first.body.key);
		const got = await api("GET", `/v1/tasks/reupload/snapshots/${state}`, {
			key: keys.trainer,
		});
		expect(got.status).toBe(200);
		expect(got.headers.get("content-length")).toBe("7");
	});

	it("refuses a blob larger than the limit before reading it", async () => {
		const r = await api(
			"PUT",
			`/v1/tasks/big/snapshots/${"e".repeat(64)}?driver=workspace`,
			{
				key: keys.host,
				body: "x",
				headers: { "content-length": String(2 ** 40) },
			},
		);
		expectError(r, 413, "too_large");
		expect(
			await env.BLOBS.head(`snapshots/snaps/big/${"e".repeat(64)}`),
		).toBeNull();
	});
});
