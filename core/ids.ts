/**
 * Canonical ids (the brief's invariant 2), shared by the Worker, the task
 * graph Durable Object and the clients. Every id is a SHA-256 digest written
 * as 64 lowercase hex characters.
 *
 * - call key   = H(JCS({"args": args, "tool": tool}))   (`mutates` excluded)
 * - root       = H("trellis/v1/root")
 * - child      = H(parent ‖ key)             raw 32-byte digests concatenated
 * - obs result = H(state ‖ "obs" ‖ key)      for calls that do not mutate
 *
 * SHA-256 is @noble/hashes' synchronous implementation: it runs the same in
 * Node and workerd, lets a Durable Object compute ids without yielding to
 * other requests, and on the short inputs ids hash it costs a fraction of
 * `node:crypto` under workerd's `nodejs_compat`, whose `Buffer` conversions
 * dominated a cache hit's CPU profile.
 */
import { sha256 } from "@noble/hashes/sha2.js";
import { bytesToHex, hexToBytes } from "@noble/hashes/utils.js";
import canonicalize from "canonicalize";

/** A tool call as the cache sees it. */
export interface Call {
	tool: string;
	/** Any JSON value; `null` when the tool takes no arguments. */
	args?: unknown;
	/** Whether the call changes sandbox state; `true` unless said otherwise. */
	mutates?: boolean;
}

/** One encoder for every call: noble's `utf8ToBytes` makes one and a copy each time. */
const utf8 = new TextEncoder();
const OBS = utf8.encode("obs");

/** SHA-256 of the concatenation of `parts`, as hex: one buffer, hashed in one call. */
function digestHex(...parts: Uint8Array[]): string {
	if (parts.length === 1) return bytesToHex(sha256(parts[0]));
	const all = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
	let at = 0;
	for (const p of parts) {
		all.set(p, at);
		at += p.length;
	}
	return bytesToHex(sha256(all));
}

/** The RFC 8785 canonical JSON of a call's identity: `{"args","tool"}`. */
export function canonicalCall(call: Pick<Call, "tool" | "args">): string {
	const text = canonicalize({ args: call.args ?? null, tool: call.tool });
	if (text === undefined) throw new TypeError("call is not serializable");
	return text;
}

/** The call key: SHA-256 of the canonical JSON of `{args, tool}`. */
export function callKey(call: Pick<Call, "tool" | "args">): string {
	return digestHex(utf8.encode(canonicalCall(call)));
}

/** The id of the empty state every task starts from. */
export const ROOT_ID = digestHex(utf8.encode("trellis/v1/root"));

/** The state after a state-changing call with key `key` at state `parent`. */
export function childId(parent: string, key: string): string {
	return digestHex(hexToBytes(parent), hexToBytes(key));
}

/** The result of a stateless call with key `key` run at state `state`. */
export function obsId(state: string, key: string): string {
	return digestHex(hexToBytes(state), OBS, hexToBytes(key));
}

export function mutates(call: Call): boolean {
	return call.mutates !== false;
}

/** One call of a path with its key, the state it ran at, and its result id. */
export interface PathStep {
	key: string;
	/** The state the call ran at. */
	state: string;
	/** The state after the call if it mutates, else its result id. */
	id: string;
	mutates: boolean;
}

/** The ids of every call of a path that starts at `from` (the root by default). */
export function pathIds(
	calls: readonly Call[],
	from: string = ROOT_ID,
): PathStep[] {
	let state = from;
	return calls.map((call) => {
		const key = callKey(call);
		const m = mutates(call);
		const id = m ? childId(state, key) : obsId(state, key);
		const step = { key, state, id, mutates: m };
		if (m) state = id;
		return step;
	});
}

/** The state a path leaves the sandbox in: stateless calls do not move it. */
export function finalState(
	calls: readonly Call[],
	from: string = ROOT_ID,
): string {
	let state = from;
	for (const call of calls)
		if (mutates(call)) state = childId(state, callKey(call));
	return state;
}

export const ID_PATTERN = /^[0-9a-f]{64}$/;
