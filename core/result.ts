/**
 * What a Durable Object RPC method returns: a value, or an API error for the
 * Worker to send. Errors are returned, not thrown, because a thrown error's
 * class does not survive the RPC boundary.
 */
export type Status = 400 | 401 | 403 | 404 | 409 | 413 | 429 | 503;

export interface Failure {
	ok: false;
	status: Status;
	code: string;
	message: string;
}
export type Result<T> = { ok: true; value: T } | Failure;

export function ok<T>(value: T): Result<T> {
	return { ok: true, value };
}

export function fail(status: Status, code: string, message: string): Failure {
	return { ok: false, status, code, message };
}
