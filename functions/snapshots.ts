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
 */
import { Hono } from "hono";
import { Id, LIMITS, type SnapshotRef } from "../core/api.ts";
import type { AppEnv } from "./app.ts";
import { allow, graph, taskScope } from "./auth.ts";
import { apiError } from "./errors.ts";

export const snapshots = new Hono<AppEnv>();

const blobs = allow(["trainer", "host", "admin"]);

function blobPrefix(project: string, task: string, state: string): string {
	return `snapshots/${project}/${task}/${state}/`;
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
	// points at.
	const { project, task } = c.get("scope");
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
	const obj = put.value;
	const ref: SnapshotRef = { driver, key, bytes: obj.size };
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
