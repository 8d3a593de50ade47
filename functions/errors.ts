/**
 * Every error leaves the Worker as `{ error: { code, message } }` with its
 * status. Handlers throw `apiError(...)`; `onError` turns the Durable Object
 * runtime's overload and transient errors into 503s, and anything else into
 * a generic 500 after logging it.
 */
import type { Context, ErrorHandler, NotFoundHandler } from "hono";
import { HTTPException } from "hono/http-exception";
import type { ContentfulStatusCode } from "hono/utils/http-status";
import type { Failure } from "../core/result.ts";

/** Seconds a client should wait after a task graph said it is overloaded. */
export const OVERLOADED_RETRY_AFTER_SECONDS = 5;
/** ... and after a transient Durable Object error (a restart, a move). */
export const UNAVAILABLE_RETRY_AFTER_SECONDS = 1;

/** An error response of the API's shape, to throw from a handler. */
export function apiError(
	status: ContentfulStatusCode,
	code: string,
	message: string,
	headers?: Record<string, string>,
): HTTPException {
	return new HTTPException(status, {
		res: Response.json({ error: { code, message } }, { status, headers }),
	});
}

/** Unwraps a Durable Object result, throwing its failure as an API error. */
export function unwrap<T>(r: { ok: true; value: T } | Failure): T {
	if (r.ok) return r.value;
	throw apiError(r.status, r.code, r.message);
}

/** The app's one error handler: every failure becomes a JSON error. */
export const onError: ErrorHandler = (err, c) => {
	if (err instanceof HTTPException) {
		const res = err.getResponse();
		if (res.headers.get("content-type")?.includes("application/json"))
			return res;
		// Hono's own exceptions (body limit, malformed JSON) carry plain text.
		return c.json(
			{
				error: {
					code: /json/i.test(err.message)
						? "invalid_json"
						: codeFor(err.status),
					message: err.message || "request refused",
				},
			},
			err.status,
		);
	}
	// The Durable Object runtime marks its own errors: `overloaded` when one
	// object has more queued than it can take (retrying at once makes it
	// worse, so the client is told to back off), `retryable` when it was
	// transient (the object restarted or moved). Only the one task's object
	// is affected; other tasks keep answering. Both are the server's state,
	// not the request's fault, so 503, never 500.
	const flags = err as { overloaded?: unknown; retryable?: unknown };
	if (flags.overloaded === true) {
		return c.json(
			{
				error: {
					code: "overloaded",
					message: "this task is receiving more requests than it can take",
				},
			},
			503,
			{ "Retry-After": String(OVERLOADED_RETRY_AFTER_SECONDS) },
		);
	}
	if (flags.retryable === true) {
		console.warn("transient Durable Object error", err);
		return c.json(
			{
				error: {
					code: "unavailable",
					message: "the task is briefly unavailable; retry",
				},
			},
			503,
			{ "Retry-After": String(UNAVAILABLE_RETRY_AFTER_SECONDS) },
		);
	}
	console.error("unhandled error", err);
	return c.json(
		{ error: { code: "internal", message: "internal error" } },
		500,
	);
};

function codeFor(status: number): string {
	switch (status) {
		case 400:
			return "invalid_request";
		case 401:
			return "unauthorized";
		case 413:
			return "too_large";
		case 429:
			return "rate_limited";
		default:
			return "error";
	}
}

/** Unknown routes: a JSON 404 like every other error. */
export const notFound: NotFoundHandler = (c: Context) =>
	c.json(
		{
			error: {
				code: "not_found",
				message: `no route for ${c.req.method} ${c.req.path}`,
			},
		},
		404,
	);
