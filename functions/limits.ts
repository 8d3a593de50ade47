/**
 * Per-key rate limits, counted by the Workers Rate Limiting binding
 * (`[[ratelimits]]` RATE_LIMITER in wrangler.toml). Runs after
 * authentication, so every `/v1` request is counted against the key that
 * sent it; the root admin key is one key like the others. Requests without a
 * valid key are refused by authentication before they can be counted: there
 * is nothing to key them on but the address, and the platform's own rules are
 * the place for that.
 *
 * The platform counts per Cloudflare location and takes the limit and period
 * from the binding's `simple` settings, not from `[vars]`: change the limit
 * there, per environment. The binding does not say when its window ends, so
 * `Retry-After` is a whole period, always long enough.
 */
import { createMiddleware } from "hono/factory";
import type { AppEnv } from "./app.ts";
import { apiError } from "./errors.ts";

/** The binding's `simple.period` in wrangler.toml (10 or 60). */
export const RATE_LIMIT_PERIOD_SECONDS = 10;

/** What the limiter counts a principal under. */
export function limitKey(p: AppEnv["Variables"]["principal"]): string {
	return p.kind === "root" ? "root" : `key:${p.keyId}`;
}

/** Refuses a request past its key's limit with 429 and `Retry-After`. */
export const rateLimit = createMiddleware<AppEnv>(async (c, next) => {
	const { success } = await c.env.RATE_LIMITER.limit({
		key: limitKey(c.get("principal")),
	});
	if (!success) {
		throw apiError(
			429,
			"rate_limited",
			`this key sent more requests than its limit allows; retry in ${RATE_LIMIT_PERIOD_SECONDS} s`,
			{ "Retry-After": String(RATE_LIMIT_PERIOD_SECONDS) },
		);
	}
	await next();
});
