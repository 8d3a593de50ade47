/**
 * Every error leaves the Worker as `{ error: { code, message } }` with its
 * status. Handlers throw `apiError(...)`; `onError` turns anything else into
 * a generic 500 after logging it.
 */
import type { Context, ErrorHandler, NotFoundHandler } from "hono";
import { HTTPException } from "hono/http-exception";
import type { ContentfulStatusCode } from "hono/utils/http-status";
import type { Failure } from "../core/result.ts";

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
		default:
			return "error";
	}
}

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
