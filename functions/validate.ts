/**
 * zod validation on hono's validator: a failure becomes a 400 with code
 * `invalid_request` and the first issue; a body that is not JSON becomes a
 * 400 with code `invalid_json` (functions/errors.ts). Handlers read input only
 * via `c.req.valid`, or, on the lookup route, through {@link parseJson}.
 *
 * Not @hono/zod-validator: it parses with `safeParseAsync`, and every schema
 * here is synchronous; zod's async parse costs several times the CPU of the
 * same checks run synchronously, on every request.
 */
import type { Context, ValidationTargets } from "hono";
import { bodyLimit } from "hono/body-limit";
import { createMiddleware } from "hono/factory";
import { validator } from "hono/validator";
import type { z } from "zod";
import { firstIssue } from "../core/api.ts";
import { apiError } from "./errors.ts";

export function valid<
	T extends z.ZodType,
	Target extends keyof ValidationTargets,
>(target: Target, schema: T) {
	return validator(target, (value): z.output<T> => check(schema, value));
}

function check<T extends z.ZodType>(schema: T, value: unknown): z.output<T> {
	const result = schema.safeParse(value);
	if (!result.success)
		throw apiError(400, "invalid_request", firstIssue(result.error));
	return result.data;
}

/** hono's own test of a JSON media type, as its validator applies it. */
const JSON_TYPE = /^application\/([\w.-]+\+)?json$/i;

/**
 * The body's text when it says it is JSON, else null. With {@link parseJson}
 * it reads a body as `valid("json", schema)` does, for a handler that also
 * needs the text itself (the lookup route keys its edge memory on it).
 */
export async function jsonText(c: Context): Promise<string | null> {
	const type = c.req.header("Content-Type")?.split(";")[0].trim() ?? "";
	// Like hono's validator: a body that does not say it is JSON is not read.
	return JSON_TYPE.test(type) ? c.req.text() : null;
}

/** `text` from {@link jsonText} parsed and validated; null validates `{}`. */
export function parseJson<T extends z.ZodType>(
	schema: T,
	text: string | null,
): z.output<T> {
	if (text === null) return check(schema, {});
	let value: unknown;
	try {
		value = JSON.parse(text);
	} catch {
		throw apiError(400, "invalid_json", "Malformed JSON in request body");
	}
	return check(schema, value);
}

/**
 * A JSON body of at most `max` bytes; larger bodies get 413 before parsing.
 * A body that declares its length is judged by that header alone (HTTP
 * framing ends it there); hono's `bodyLimit`, which counts a body without
 * one as it streams, first asks for `req.body`, and on every request that
 * makes the runtime a stream object to finalize later (see tasks.ts json).
 */
export function jsonBody(max: number) {
	const tooLarge = () => {
		throw apiError(413, "too_large", `the body is larger than ${max} bytes`);
	};
	const streamed = bodyLimit({ maxSize: max, onError: tooLarge });
	return createMiddleware(async (c, next) => {
		const length = c.req.header("content-length");
		if (length === undefined || c.req.header("transfer-encoding") !== undefined)
			return streamed(c, next);
		if (Number(length) > max) tooLarge();
		await next();
	});
}
