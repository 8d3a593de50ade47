/**
 * Snapshot blobs for a task's states, streamed into and out of R2 at
 * `snapshots/{project}/{task}/{state}/{upload}`. The Worker only stores
 * bytes; making and restoring snapshots is a sandbox's job. A record then
 * points the node at its blob (the returned ref).
 *
 * Every upload gets a key of its own. With one key per state, an eviction
 * deleting a state's old blob could, after its transaction, delete a new
 * blob uploaded and recorded for the same state meanwhile: a node (and a
 * lease) would point at nothing. The soak benchmark caught exactly that.
 *
 * A ref in a record is checked here before the task graph sees it (see
 * {@link checkSnapshots}): the task graph serves a node's key on download
 * and deletes it on eviction, so a key of another task or project, or of
 * an output, would let a client read or delete a blob that is not its own.
 */
import { Hono } from "hono";
import { Id, LIMITS, type SnapshotRef } from "../core/api.ts";
import type { Scope } from "../durable-objects/task-graph.ts";
import type { AppEnv } from "./app.ts";
import { allow, graph, taskScope } from "./auth.ts";
import { budgetsFor, quotaError } from "./budgets.ts";
import { apiError } from "./errors.ts";

export const snapshots = new Hono<AppEnv>();

const blobs = allow(["trainer", "host", "admin"]);

/** Where every snapshot blob of a task is: the only keys its records may name. */
function taskPrefix({ project, task }: Scope): string {
	return `snapshots/${project}/${task}/`;
}

function blobPrefix(project: string, task: string, state: string): string {
	return `${taskPrefix({ project, task })}${state}/`;
}

/**
 * The snapshot refs of a record's calls, checked against R2, with the sizes
 * R2 gives (a client's `bytes` would feed the budgets whatever it claims).
 * A key outside `snapshots/{project}/{task}/{state}/`, where `state` is the
 * state after the call (`states[i]`), is 400 `invalid_snapshot`, as is a
 * driver that is not the blob's; nothing is written then. So a node only
 * ever points at a snapshot of its own state, and no two nodes at one blob. A key with no blob behind it (swept, or evicted between a
 * record and its retry) is no error: the call is recorded without a
 * snapshot, which only costs a later restore its shortcut, and its result
 * says `snapshot: "missing"` (`missing` lists those calls). Failing the
 * record instead would make the retry of an acknowledged record fail.
 */
export async function checkSnapshots(
	env: Env,
	scope: Scope,
	snapshots: (SnapshotRef | undefined)[],
	states: string[],
): Promise<{ refs: (SnapshotRef | undefined)[]; missing: number[] }> {
	let named = 0;
	for (const [i, ref] of snapshots.entries()) {
		if (ref === undefined) continue;
		const prefix = blobPrefix(scope.project, scope.task, states[i]);
		if (!ref.key.startsWith(prefix) || ref.key.length === prefix.length) {
			throw apiError(
				400,
				"invalid_snapshot",
				`calls.${i}.snapshot.key: must be a key the snapshot upload route gave for this task and the state after this call (under ${prefix})`,
			);
		}
		named++;
	}
	if (named === 0) return { refs: snapshots, missing: [] };
	let heads: (R2Object | null | undefined)[];
	try {
		heads = await Promise.all(
			snapshots.map((ref) => (ref ? env.BLOBS.head(ref.key) : undefined)),
		);
	} catch (err) {
		console.error("R2 refused to head snapshot blobs", err);
		throw apiError(
			503,
			"storage_unavailable",
			"blob storage did not answer; nothing was recorded, retry",
			{ "Retry-After": "1" },
		);
	}
	const missing: number[] = [];
	const refs = snapshots.map((ref, i) => {
		if (ref === undefined) return undefined;
		const head = heads[i];
		if (!head) {
			missing.push(i);
			return undefined;
		}
		const driver = head.customMetadata?.driver;
		if (driver !== undefined && driver !== ref.driver) {
			throw apiError(
				400,
				"invalid_snapshot",
				`calls.${i}.snapshot.driver: the blob was uploaded for driver ${driver}`,
			);
		}
		return { driver: ref.driver, key: ref.key, bytes: head.size };
	});
	return { refs, missing };
}

function stateParam(raw: string): string {
	const r = Id.safeParse(raw);
	if (!r.success)
		throw apiError(
			400,
			"invalid_request",
			"state: must be 64 lowercase hex digits",
		);
	return r.data;
}

snapshots.put("/:task/snapshots/:state", taskScope, blobs, async (c) => {
	const state = stateParam(c.req.param("state"));
	const driver = c.req.query("driver") ?? "";
	if (!/^[a-z0-9_-]{1,64}$/.test(driver)) {
		throw apiError(
			400,
			"invalid_request",
			"driver: give ?driver= (a-z 0-9 _ -, 1-64)",
		);
	}
	const length = Number(c.req.header("content-length") ?? NaN);
	if (!Number.isSafeInteger(length) || length < 0) {
		throw apiError(
			400,
			"length_required",
			"send the blob with a Content-Length",
		);
	}
	if (length > LIMITS.snapshotBody) {
		throw apiError(
			413,
			"too_large",
			`a snapshot blob may be at most ${LIMITS.snapshotBody} bytes`,
		);
	}
	// A blob for a state the task does not hold yet is allowed: hosts upload
	// right after executing, before they record. The cron sweeps blobs no node
	// points at, after a grace period, in the tasks of the task index.
	const scope = c.get("scope");
	const { project, task } = scope;
	// The project's quotas, as for a record: a new task past the task quota,
	// or a blob that would take the project past its bytes. (Usage counts
	// blobs once recorded; one not yet recorded lives at most the grace.)
	const refused = await quotaError(
		c.env,
		project,
		task,
		await budgetsFor(c.env, project),
		length,
	);
	if (refused) throw apiError(403, "quota_exceeded", refused);
	const key = blobPrefix(project, task, state) + crypto.randomUUID();
	const body =
		c.req.raw.body ?? new ReadableStream({ start: (ctl) => ctl.close() });
	// R2 needs the stream's length up front; FixedLengthStream also refuses a
	// body that is longer or shorter than it said.
	const sized = new FixedLengthStream(length);
	// Count what arrives: the client is at fault (400) if more bytes came
	// than it said, or the body ended short; otherwise storage is (503).
	// Which side of the pipe fails first is a race and cannot tell. If R2
	// gives up without reading, the pipe is aborted, or it would wait forever.
	let received = 0;
	let ended = false;
	const counted = body.pipeThrough(
		new TransformStream<Uint8Array, Uint8Array>({
			transform(chunk, ctl) {
				received += chunk.byteLength;
				ctl.enqueue(chunk);
			},
			flush() {
				ended = true;
			},
		}),
	);
	const abort = new AbortController();
	const piped = counted.pipeTo(sized.writable, { signal: abort.signal });
	const stored = c.env.BLOBS.put(key, sized.readable, {
		customMetadata: { driver },
	});
	stored.catch((err: unknown) => abort.abort(err));
	const [pipe, put] = await Promise.allSettled([piped, stored]);
	if (received > length || (ended && received !== length)) {
		throw apiError(
			400,
			"length_mismatch",
			"the body's length differs from its Content-Length",
		);
	}
	if (pipe.status === "rejected" || put.status === "rejected") {
		console.error("R2 refused a snapshot blob", key);
		throw apiError(
			503,
			"storage_unavailable",
			"blob storage refused the write, or the upload was cut off; nothing was stored, retry",
			{ "Retry-After": "1" },
		);
	}
	// The task graph learns its task (it indexes itself in D1 with its next
	// alarm, as after any change), so that the cron visits the task and
	// sweeps the blob if no record ever points a node at it (invariant 4). A
	// task that only ever uploads is otherwise never in the index. If the
	// graph cannot be told, the blob is taken back: nothing would sweep it.
	try {
		await graph(c).noteUpload(scope);
	} catch (err) {
		await c.env.BLOBS.delete(key).catch((e: unknown) =>
			console.error("could not delete an unindexed snapshot blob", key, e),
		);
		console.error("the task graph did not take note of an upload", err);
		throw apiError(
			503,
			"unavailable",
			"the task graph did not answer; the upload was taken back, retry",
			{ "Retry-After": "1" },
		);
	}
	const ref: SnapshotRef = { driver, key, bytes: put.value.size };
	return c.json(ref, 201);
});

snapshots.get("/:task/snapshots/:state", taskScope, blobs, async (c) => {
	const state = stateParam(c.req.param("state"));
	const { project, task } = c.get("scope");
	// The blob the state's node points at; before any record points at one,
	// the latest upload for the state.
	let key = await graph(c).snapshotKey(state);
	if (key === null) {
		const listed = await c.env.BLOBS.list({
			prefix: blobPrefix(project, task, state),
		});
		const latest = listed.objects.sort(
			(a, b) => b.uploaded.getTime() - a.uploaded.getTime(),
		)[0];
		key = latest?.key ?? null;
	}
	const obj = key === null ? null : await c.env.BLOBS.get(key);
	if (!obj)
		throw apiError(
			404,
			"snapshot_not_found",
			"no snapshot blob for this state",
		);
	return new Response(obj.body, {
		headers: {
			"content-type": "application/octet-stream",
			"content-length": String(obj.size),
			"x-trellis-driver": obj.customMetadata?.driver ?? "",
		},
	});
});
