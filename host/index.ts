/**
 * The container host: run sandboxes where they live and serve them to the
 * Worker over signed HTTP. See `host/server.ts` for the service and
 * `host/registry.ts` for how drivers plug in by name.
 */
export {
	createHost,
	isBlobKey,
	type Host,
	type HostEnv,
	type HostOptions,
} from "./server.ts";
export {
	DriverUnavailableError,
	HOST_LABEL,
	LOADERS,
	UnknownTemplateError,
	capOutput,
	loadDrivers,
	type DriverConfig,
	type DriverLoader,
	type ExecLimits,
	type HostDriver,
	type HostExecResult,
	type LoadedDrivers,
} from "./registry.ts";
