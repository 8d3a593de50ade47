/**
 * zod validation on hono's validator: a failure becomes a 400 with code
 * `invalid_request` and the first issue; a body that is not JSON becomes a
 * 400 with code `invalid_json` (functions/errors.ts). Handlers read input only
 * via `c.req.valid`.
 *
 * Not @hono/zod-validator: it parses with `safeParseAsync`, and every schema
 * here is synchronous; zod's async parse costs several times the CPU of the
 * same checks run synchronously, on every request.
 */
import type { ValidationTargets } from "hono";
import { bodyLimit } from "hono/body-limit";
import { validator } from "hono/validator";
import type { z } from "zod";
import { apiError } from "./errors.ts";

export function valid<
	T extends z.ZodType,
	Target extends keyof ValidationTargets,
>(target: Target, schema: T) {
	return validator(target, (value): z.output<T> => {
		const result = schema.safeParse(value);
		if (!result.success) {
			const issue = result.error.issues[0];
			const where = issue.path.length > 0 ? `${issue.path.join(".")}: ` : "";
			throw apiError(400, "invalid_request", `${where}${issue.message}`);
		}
		return result.data;
	});
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
