/**
 * zod validation on hono's validator: a failure becomes a 400 with code
 * `invalid_request` and the first issue; a body that is not JSON becomes a
 * 400 with code `invalid_json` (functions/errors.ts). Handlers read input only
 * via `c.req.valid`, or, on the lookup route, through {@link memoJson}.
 *
 * Not @hono/zod-validator: it parses with `safeParseAsync`, and every schema
 * here is synchronous; zod's async parse costs several times the CPU of the
 * same checks run synchronously, on every request.
 */
import type { Context, ValidationTargets } from "hono";
import { LRUCache } from "lru-cache";
import { bodyLimit } from "hono/body-limit";
import { validator } from "hono/validator";
import type { z } from "zod";
import { apiError } from "./errors.ts";

export function valid<
	T extends z.ZodType,
	Target extends keyof ValidationTargets,
>(target: Target, schema: T) {
	return validator(target, (value): z.output<T> => check(schema, value));
}

function check<T extends z.ZodType>(schema: T, value: unknown): z.output<T> {
	const result = schema.safeParse(value);
	if (!result.success) {
		const issue = result.error.issues[0];
		const where = issue.path.length > 0 ? `${issue.path.join(".")}: ` : "";
		throw apiError(400, "invalid_request", `${where}${issue.message}`);
	}
	return result.data;
}

/** hono's own test of a JSON media type, as its validator applies it. */
const JSON_TYPE = /^application\/([\w.-]+\+)?json$/i;

/**
 * A JSON body read as `valid("json", schema)` reads it, with what `derive`
 * makes of the valid value, remembered by the body's text in this isolate.
 *
 * Parsing, validating and deriving are functions of the text alone, so the
 * same text always gives the same result, and a text seen before skips all
 * three. That is the lookup route's case: the rollouts of a group send the
 * same history, or the same cursor, with the same call, and on a hit the
 * JSON parse, zod and the ids of the path were most of the Worker's own
 * CPU. Only valid bodies of at most `maxChars` characters are remembered,
 * up to about `maxBytes` (the text and its parsed value, estimated at three
 * times the text). The result is shared: callers must not change it.
 */
export function memoJson<T extends z.ZodType, D>(
	schema: T,
	derive: (value: z.output<T>) => D,
	opts: { maxChars: number; maxBytes: number },
): (c: Context) => Promise<D> {
	const seen = new LRUCache<string, { derived: D }>({
		maxSize: opts.maxBytes,
		sizeCalculation: (_v, text) => text.length * 6 + 256,
	});
	return async (c) => {
		const type = c.req.header("Content-Type")?.split(";")[0].trim() ?? "";
		// Like hono's validator: a body that does not say it is JSON is not read.
		if (!JSON_TYPE.test(type)) return derive(check(schema, {}));
		const text = await c.req.text();
		const known = seen.get(text);
		if (known) return known.derived;
		let value: unknown;
		try {
			value = JSON.parse(text);
		} catch {
			throw apiError(400, "invalid_json", "Malformed JSON in request body");
		}
		const derived = derive(check(schema, value));
		if (text.length <= opts.maxChars) seen.set(text, { derived });
		return derived;
	};
}

/** A JSON body of at most `max` bytes; larger bodies get 413 before parsing. */
export function jsonBody(max: number) {
	return bodyLimit({
		maxSize: max,
		onError: () => {
			throw apiError(413, "too_large", `the body is larger than ${max} bytes`);
		},
	});
}
