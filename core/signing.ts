/**
 * Requests the Worker sends a container host are signed: HMAC-SHA256, keyed
 * with the secret the Worker issued the host when it registered, over
 *
 *   METHOD \n PATH(with query) \n hex SHA-256 of the body \n TIMESTAMP \n NONCE
 *
 * A host refuses a request whose timestamp is more than MAX_SKEW_MS away from
 * its clock, and a nonce it has seen inside that window (a replay).
 */
import { createHash, createHmac, timingSafeEqual } from "node:crypto";

export const MAX_SKEW_MS = 30_000;

export const HEADERS = {
	timestamp: "x-trellis-timestamp",
	nonce: "x-trellis-nonce",
	signature: "x-trellis-signature",
} as const;

function bodyDigest(body: string | Uint8Array): string {
	return createHash("sha256").update(body).digest("hex");
}

export function signature(
	secret: string,
	method: string,
	path: string,
	body: string | Uint8Array,
	timestamp: string,
	nonce: string,
): string {
	return createHmac("sha256", secret)
		.update(
			`${method.toUpperCase()}\n${path}\n${bodyDigest(body)}\n${timestamp}\n${nonce}`,
		)
		.digest("hex");
}

/** The headers that sign one request. */
export function sign(
	secret: string,
	method: string,
	path: string,
	body: string | Uint8Array,
	now: number,
): Record<string, string> {
	const timestamp = String(now);
	const nonce = crypto.randomUUID();
	return {
		[HEADERS.timestamp]: timestamp,
		[HEADERS.nonce]: nonce,
		[HEADERS.signature]: signature(
			secret,
			method,
			path,
			body,
			timestamp,
			nonce,
		),
	};
}

export type Verdict =
	| { ok: true }
	| { ok: false; code: "unsigned" | "bad_signature" | "stale" | "replayed" };

/**
 * Checks a request's signature; `seen` remembers nonces for the skew window
 * (the caller owns it, one per host process).
 */
export function verify(
	secret: string,
	method: string,
	path: string,
	body: string | Uint8Array,
	headers: { get(name: string): string | null | undefined },
	now: number,
	seen: Map<string, number>,
): Verdict {
	const timestamp = headers.get(HEADERS.timestamp);
	const nonce = headers.get(HEADERS.nonce);
	const given = headers.get(HEADERS.signature);
	if (!timestamp || !nonce || !given) return { ok: false, code: "unsigned" };
	const expected = signature(secret, method, path, body, timestamp, nonce);
	const a = Buffer.from(expected, "hex");
	const b = Buffer.from(given, "hex");
	if (a.length !== b.length || !timingSafeEqual(a, b)) {
		return { ok: false, code: "bad_signature" };
	}
	if (
		Math.abs(now - Number(timestamp)) > MAX_SKEW_MS ||
		!/^\d+$/.test(timestamp)
	) {
		return { ok: false, code: "stale" };
	}
	for (const [n, at] of seen) if (at < now - MAX_SKEW_MS * 2) seen.delete(n);
	if (seen.has(nonce)) return { ok: false, code: "replayed" };
	seen.set(nonce, now);
	return { ok: true };
}
