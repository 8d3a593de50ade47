import { env } from "cloudflare:workers";
import { runDurableObjectAlarm } from "cloudflare:test";
import { beforeAll, describe, expect, it } from "vitest";
import { advanceClock } from "../../core/clock.ts";
import {
	ROOT_ID,
	ROOT_KEY,
	api,
	bash,
	expectError,
	project,
	run,
	taskApi,
	stateAfter,
	runCron,
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

describe("snapshot refs in a record", () => {
	const upload = (task: string, state: string, body: Uint8Array) =>
		api("PUT", `/v1/tasks/${task}/snapshots/${state}?driver=workspace`, {
			key: keys.host,
			body,
		});
	const recordWith = (task: string, snapshot: unknown) =>
		taskApi(keys.trainer, task).record({
			from: ROOT_ID,
			calls: [{ ...run(bash("build"), "built"), snapshot }],
		});
	// The state after `recordWith`'s call: the one its snapshot must be of.
	const state = stateAfter(bash("build"));

	it("refuses a key outside the task's own prefix with 400 invalid_snapshot, and records nothing", async () => {
		// A real blob of another task of this project, and of another project.
		const theirs = await upload("victim", state, bytes(4));
		expect(theirs.status).toBe(201);
		const other = await project("snaps-thief");
		const stranger = await api(
			"PUT",
			`/v1/tasks/thief/snapshots/${state}?driver=workspace`,
			{ key: other.host, body: bytes(4) },
		);
		expect(stranger.status).toBe(201);
		for (const key of [
			theirs.body.key,
			stranger.body.key,
			"snapshots/snaps/thief-x/y",
			"snapshots/snaps/thief",
			"outputs/snaps/thief/abc",
			"k",
		]) {
			const r = await recordWith("thief", {
				driver: "workspace",
				key,
				bytes: 4,
			});
			expectError(r, 400, "invalid_snapshot");
		}
		expectError(
			await taskApi(keys.trainer, "thief").stats(),
			404,
			"task_not_found",
		);
		// Both blobs are still there, and still only their own tasks'.
		expect(await env.BLOBS.head(theirs.body.key)).not.toBeNull();
		expect(await env.BLOBS.head(stranger.body.key)).not.toBeNull();
	});

	it("refuses a blob of this task but of another state with 400 invalid_snapshot", async () => {
		const other = await upload("wrong-state", "b".repeat(64), bytes(4));
		expect(other.status).toBe(201);
		expectError(
			await recordWith("wrong-state", other.body),
			400,
			"invalid_snapshot",
		);
		// Nothing was recorded: the task holds only what the upload made.
		expect(
			(await taskApi(keys.trainer, "wrong-state").stats()).body,
		).toMatchObject({ nodes: 1, snapshots: 0 });
	});

	it("records a call whose snapshot blob is gone without a snapshot, and says so", async () => {
		const up = await upload("missing", state, bytes(4));
		await env.BLOBS.delete(up.body.key);
		const r = await recordWith("missing", up.body);
		expect(r.status).toBe(200);
		expect(r.body.results).toEqual([
			{ id: r.body.state, status: "recorded", snapshot: "missing" },
		]);
		// Never uploaded: the same.
		const never = await taskApi(keys.trainer, "missing").record({
			from: ROOT_ID,
			calls: [
				{
					...run(bash("other"), "o"),
					snapshot: {
						driver: "workspace",
						key: `snapshots/snaps/missing/${stateAfter(bash("other"))}/never-uploaded`,
						bytes: 1,
					},
				},
			],
		});
		expect(never.body.results[0]).toMatchObject({
			status: "recorded",
			snapshot: "missing",
		});
		// Both calls stand; no node points at a blob, and none is counted.
		const t = taskApi(keys.trainer, "missing");
		expect((await t.stats()).body).toMatchObject({
			nodes: 3,
			snapshots: 0,
			snapshotBytes: 0,
		});
		const nodes = (await t.graph()).body.nodes as { snapshot: unknown }[];
		expect(nodes.every((n) => n.snapshot === null)).toBe(true);
		// A call whose blob is there has no such mark.
		const there = await upload("missing", stateAfter(bash("third")), bytes(4));
		const ok = await taskApi(keys.trainer, "missing").record({
			from: ROOT_ID,
			calls: [{ ...run(bash("third"), "3"), snapshot: there.body }],
		});
		expect(ok.body.results[0]).toEqual({
			id: ok.body.state,
			status: "recorded",
		});
	});

	it("refuses a ref whose driver is not the blob's with 400 invalid_snapshot", async () => {
		const up = await upload("driver", state, bytes(4));
		expectError(
			await recordWith("driver", { ...up.body, driver: "docker" }),
			400,
			"invalid_snapshot",
		);
		// The upload made the task known; the record added nothing to it.
		expect((await taskApi(keys.trainer, "driver").stats()).body).toMatchObject({
			nodes: 1,
			snapshots: 0,
			snapshotBytes: 0,
		});
	});

	it("takes a snapshot's size from R2, not from the client's claim", async () => {
		const t = taskApi(keys.trainer, "liar");
		const up = await upload("liar", state, bytes(10));
		const rec = await recordWith("liar", { ...up.body, bytes: 1e12 });
		expect(rec.status).toBe(200);
		expect((await t.stats()).body).toMatchObject({
			snapshots: 1,
			snapshotBytes: 10,
		});
		const miss = await t.lookup({
			history: [bash("build")],
			call: bash("test"),
		});
		expect(miss.body.snapshot).toMatchObject({ key: up.body.key, bytes: 10 });
	});
});

describe("an upload the task graph cannot take note of", () => {
	it("answers 503 with Retry-After and takes the blob back", async () => {
		// A task graph that fails when told of the upload: the one fault here
		// that the real object cannot be made to produce on demand.
		const down: Env = {
			...env,
			TASK_GRAPH: {
				idFromName: (name: string) => env.TASK_GRAPH.idFromName(name),
				get: () => ({
					noteUpload: async () => {
						throw new Error("the object is gone");
					},
				}),
			} as unknown as Env["TASK_GRAPH"],
		};
		const state = "c".repeat(64);
		const r = await api(
			"PUT",
			`/v1/tasks/unnoted/snapshots/${state}?driver=workspace`,
			{
				key: keys.host,
				body: bytes(4),
				headers: { "content-length": "4" },
				env: down,
			},
		);
		expectError(r, 503, "unavailable");
		expect(r.headers.get("retry-after")).toBe("1");
		expect(
			(await env.BLOBS.list({ prefix: "snapshots/snaps/unnoted/" })).objects,
		).toHaveLength(0);
	});
});

// These move the clock (an hour and more): they come last in the file.
describe("uploads whose record never comes", () => {
	const stub = (project: string, task: string) =>
		env.TASK_GRAPH.get(env.TASK_GRAPH.idFromName(`${project}/${task}`));

	it("are swept from a task that never records, after the grace period (invariant 4)", async () => {
		const up = await api(
			"PUT",
			`/v1/tasks/never-records/snapshots/${"b".repeat(64)}?driver=workspace`,
			{ key: keys.host, body: bytes(8) },
		);
		expect(up.status).toBe(201);
		// The task graph indexes the task with its alarm, as after any change.
		advanceClock(3000);
		await runDurableObjectAlarm(stub("snaps", "never-records"));

		await runCron();
		expect(await env.BLOBS.head(up.body.key)).not.toBeNull();
		advanceClock(Number(env.ORPHAN_GRACE_MS) + 1);
		await runCron();
		expect(await env.BLOBS.head(up.body.key)).toBeNull();
	});

	it("are refused past the project's byte quota with 403 quota_exceeded, storing nothing", async () => {
		const q = await project("snaps-bytes");
		const set = await api("PUT", "/v1/projects/snaps-bytes/budgets", {
			key: ROOT_KEY,
			json: { projectBytes: 100 },
		});
		expect(set.status).toBe(200);
		const put = (n: number) =>
			api(
				"PUT",
				`/v1/tasks/full/snapshots/${"c".repeat(64)}?driver=workspace`,
				{ key: q.host, body: bytes(n) },
			);
		expectError(await put(101), 403, "quota_exceeded");
		expect(
			(await env.BLOBS.list({ prefix: "snapshots/snaps-bytes/" })).objects,
		).toEqual([]);
		expect((await put(100)).status).toBe(201);
	});

	it("are refused for a new task past the project's task quota with 403 quota_exceeded", async () => {
		const q = await project("snaps-tasks");
		const set = await api("PUT", "/v1/projects/snaps-tasks/budgets", {
			key: ROOT_KEY,
			json: { tasks: 1 },
		});
		expect(set.status).toBe(200);
		const put = (task: string) =>
			api(
				"PUT",
				`/v1/tasks/${task}/snapshots/${"d".repeat(64)}?driver=workspace`,
				{ key: q.host, body: bytes(4) },
			);
		expect((await put("first")).status).toBe(201);
		advanceClock(3000);
		await runDurableObjectAlarm(stub("snaps-tasks", "first"));
		// Past the isolate's memory of the project's usage (10 s).
		advanceClock(10_001);
		expectError(await put("second"), 403, "quota_exceeded");
		expect(
			(await env.BLOBS.list({ prefix: "snapshots/snaps-tasks/second/" }))
				.objects,
		).toEqual([]);
		expect((await put("first")).status).toBe(201);
	});
});
