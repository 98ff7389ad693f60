#!/usr/bin/env bash
# The PGXN metadata, and the version kept in step (issue 19).
#
# META.json validates against the PGXN Meta Spec v1 with PGXN's own validator, the
# `pgxn_meta` command of the pgxn_meta crate (installed here from crates.io with cargo
# if missing). Cargo.toml's version is the one version: META.json's version and its
# provides.pg_quota version equal it, so does Cargo.lock's entry for pg_quota, and
# pg_quota.control takes it from Cargo (default_version = '@CARGO_VERSION@', which
# cargo pgrx fills in; tests/scripts/package.sh checks the packaged control file shows
# it). An update script leads to that version, so each release has an update path.
# Needs no server: the same checks run on every major.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
cd "$ROOT"
PGXN_META_VERSION=0.7.0
META="${META_JSON:-$ROOT/META.json}"  # META_JSON: another file to check, for trying a broken one

apt_install jq >&2
if ! pgxn_meta --version 2>/dev/null | grep -q "$PGXN_META_VERSION"; then
  log "installing the PGXN META.json validator, pgxn_meta $PGXN_META_VERSION (takes a minute or two)"
  cargo install pgxn_meta --version "$PGXN_META_VERSION" --locked >&2
fi

rc=0; out="$(pgxn_meta "$META" 2>&1)" || rc=$?
check "META.json validates against the PGXN Meta Spec (pgxn_meta $PGXN_META_VERSION): ${out//$'\n'/ }" \
  test "$rc" = 0 -a "$out" = "$META is OK"
expect_eq "META.json declares meta-spec 1.0.0" 1.0.0 "$(jq -r '."meta-spec".version' "$META")"

cargo_version="$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\(.*\)".*/\1/p' Cargo.toml)"
check "Cargo.toml has a version ($cargo_version)" test -n "$cargo_version"
expect_eq "META.json's version is Cargo.toml's" "$cargo_version" "$(jq -r .version "$META")"
expect_eq "META.json's provides.pg_quota.version is Cargo.toml's" "$cargo_version" "$(jq -r .provides.pg_quota.version "$META")"
expect_eq "Cargo.lock's pg_quota is Cargo.toml's version" "$cargo_version" \
  "$(sed -n '/^name = "pg_quota"$/{n;s/^version = "\(.*\)"$/\1/p}' Cargo.lock)"
expect_eq "META.json names the distribution pg_quota" pg_quota "$(jq -r .name "$META")"
expect_eq "META.json's abstract is Cargo.toml's description" \
  "$(sed -n 's/^description *= *"\(.*\)"$/\1/p' Cargo.toml)" "$(jq -r .abstract "$META")"
for key in file docfile; do
  f="$(jq -r ".provides.pg_quota.$key" "$META")"
  check "META.json's provides.pg_quota.$key ($f) exists" test -f "$ROOT/$f"
done
expect_eq "pg_quota.control takes its default_version from Cargo.toml" "'@CARGO_VERSION@'" \
  "$(sed -n 's/^default_version *= *//p' pg_quota.control)"
check "an update script sql/pg_quota--*--$cargo_version.sql leads to $cargo_version" \
  bash -c 'compgen -G "$1" >/dev/null' _ "sql/pg_quota--*--$cargo_version.sql"
finish_checks
