/*
 * CALL0: a C function that does nothing, with quota.start()'s exact signature and
 * defaults (bench/setup.sql declares it), built only for scripts/bench: the floor of
 * calling such a function from SQL, which refusals are measured against. It returns
 * NULL, as try_start() does when it refuses. FINISH0, the same for quota.finish(): with
 * CALL0 in JOBT's statements it gives JOBT0, JOBT's SQL without pg_quota's work.
 */
#include "postgres.h"
#include "fmgr.h"

PG_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(call0);

Datum
call0(PG_FUNCTION_ARGS)
{
	PG_RETURN_NULL();
}

PG_FUNCTION_INFO_V1(finish0);

Datum
finish0(PG_FUNCTION_ARGS)
{
	PG_RETURN_NULL();
}
