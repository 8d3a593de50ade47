import { applyD1Migrations } from "cloudflare:test";
import { env } from "cloudflare:workers";

// Each test file gets its own storage; bring its D1 up to the schema.
await applyD1Migrations(env.DB, env.TEST_D1_MIGRATIONS);
