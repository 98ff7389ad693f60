#!/usr/bin/env bash
# The binary package (issue 19), installed on this machine and used from its files alone.
#
# On 15 the package is postgresql-15-pg-quota_<version>_<arch>.deb, installed and removed
# with dpkg; on 18, whose server is the project's own build in /opt/pg_quota-pg/18, it is
# pg_quota-<version>-pg18-<arch>.tar.gz, extracted into that prefix and removed with the
# commands of its INSTALL note. PG_QUOTA_PACKAGE names the package to test, such as the
# release build's in target/package/; without it, `scripts/package --debug` packages the
# dev profile's build into the scratch folder (scripts/test has just built it).
#
# Checks: the package's name, fields (Depends on the server package of the same major, a
# description that says the library must be preloaded) and files: the library, the
# control file showing Cargo.toml's version, this version's install script and every
# sql/pg_quota--A--B.sql, nothing else, all root's. Then, with the pg_quota files of the
# cargo-pgrx install taken away (backed up first), so that only the package's files are
# there: it installs the package; CREATE EXTENSION pg_quota gives the packaged version;
# a database made at 0.1.0 (from the frozen tests/upgrade/pg_quota--0.1.0.sql, put into
# the extension folder for that alone and taken out again: packages ship no older full
# install script) updates with ALTER EXTENSION pg_quota UPDATE and keeps its ticket;
# start, refuse (53400) and finish work in both databases. It removes the package and
# checks that its files are gone and that dpkg no longer lists it, and puts the files
# that were there before back, byte-identical (also when a check fails: an EXIT trap).
#
# It changes the server's installation, as scripts/test's cargo pgrx install does:
# run it as root, and not beside another run that uses the same installation.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
cd "$ROOT"

VERSION="$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\(.*\)".*/\1/p' Cargo.toml)"
ARCH="$(dpkg --print-architecture)"
PKGLIBDIR="$("$PG_CONFIG" --pkglibdir)"
EXTDIR="$("$PG_CONFIG" --sharedir)/extension"
PREFIX="$(cd "$PG_BIN/.." && pwd)"
NAME="postgresql-$PG_MAJOR-pg-quota"
DEB=0; [ "$PG_MAJOR" = "$DEBIAN_MAJOR" ] && DEB=1
WHERE="$PKGLIBDIR and $EXTDIR"  # where pg_quota's files live in the server's installation
[ "$(id -u)" = 0 ] || { echo "not ok 1 - package.sh installs into $PREFIX: run it as root"; exit 1; }
if [ "$DEB" = 1 ] && dpkg-query -W -f='${Status}' "$NAME" 2>/dev/null | grep -qx 'install ok installed'; then
  echo "not ok 1 - $NAME is installed already; this test would remove it (dpkg -r $NAME first)"
  exit 1
fi

OWN_SCRATCH=""
[ -n "${SCRATCH:-}" ] || { SCRATCH="$(make_scratch)"; OWN_SCRATCH="$SCRATCH"; }
if [ -n "${PG_QUOTA_PACKAGE:-}" ]; then
  PKG="$PG_QUOTA_PACKAGE"
else
  # The dev profile's build, which scripts/test has just built and installed: a release
  # build from nothing takes many minutes on two cores, and changes no packaging step.
  log "building the package with scripts/package --pg $PG_MAJOR --debug"
  PKG="$(bash scripts/package --pg "$PG_MAJOR" --debug --out "$SCRATCH/package-build" | tail -n1)" \
    || { echo "not ok 1 - scripts/package --pg $PG_MAJOR --debug built a package"; exit 1; }
fi
log "testing $PKG"

to_err() { "$@" >&2; }  # keeps a tool's output out of the TAP lines
# pg_quota_files: the pg_quota files in the server's installation now.
pg_quota_files() {
  local f
  for f in "$PKGLIBDIR"/pg_quota.so "$PKGLIBDIR"/pg_quota-*.so "$EXTDIR"/pg_quota.control "$EXTDIR"/pg_quota--*.sql; do
    [ -e "$f" ] && echo "$f"
  done | sort
}
# The extension files a package of this version must hold, with their installed paths.
expected_files() {
  { echo "$PKGLIBDIR/pg_quota.so"; echo "$EXTDIR/pg_quota.control"; echo "$EXTDIR/pg_quota--$VERSION.sql"
    for f in sql/pg_quota--*--*.sql; do echo "$EXTDIR/$(basename "$f")"; done; } | sort
}

# --- the package itself ------------------------------------------------------------------
if [ "$DEB" = 1 ]; then
  expect_eq "the package is named as PGDG names them" "${NAME}_${VERSION}_${ARCH}.deb" "$(basename "$PKG")"
  field() { dpkg-deb -f "$PKG" "$1"; }
  expect_eq "Package: $NAME" "$NAME" "$(field Package)"
  expect_eq "Version: Cargo.toml's" "$VERSION" "$(field Version)"
  expect_eq "Architecture: $ARCH" "$ARCH" "$(field Architecture)"
  expect_eq "Depends: the server package of the same major" "postgresql-$PG_MAJOR" "$(field Depends)"
  expect_eq "Section: database" database "$(field Section)"
  check "the description says the library must be preloaded" grep -q "must be preloaded: add pg_quota to shared_preload_libraries" <<<"$(field Description)"
  # Every path in the .deb, absolute; directories end in /.
  members() { dpkg-deb --fsys-tarfile "$PKG" | tar -t | sed 's|^\./|/|; /^\/$/d'; }
  listing() { dpkg-deb --fsys-tarfile "$PKG" | tar -tv --numeric-owner; }
  packaged() { dpkg-deb --fsys-tarfile "$PKG" | tar -xO ".$1"; }
else
  base="pg_quota-$VERSION-pg$PG_MAJOR-$ARCH"
  expect_eq "the tarball is named for the version, the major and the architecture" "$base.tar.gz" "$(basename "$PKG")"
  NOTE="$(dirname "$PKG")/$base.INSTALL"
  check "its install note $base.INSTALL lies beside it" test -s "$NOTE"
  check "the note says how to install it into $PREFIX" grep -qx "    tar -xzf $base.tar.gz -C $PREFIX" "$NOTE"
  check "the note says the library must be preloaded" grep -q "shared_preload_libraries = 'pg_quota'" "$NOTE"
  check "the tarball holds no folder (extracting it changes no folder of the server)" \
    test -z "$(tar -tzf "$PKG" | grep '/$')"
  members() { tar -tzf "$PKG" | sed "s|^|$PREFIX/|"; }
  listing() { tar -tvzf "$PKG" --numeric-owner; }
  packaged() { tar -xzOf "$PKG" "${1#"$PREFIX"/}"; }
fi
ext_members="$(members | grep -v '/$' | grep -E "^($PKGLIBDIR/[^/]*|$EXTDIR/[^/]*)$" | sort)"
expect_eq "the package holds the library, the control file, the $VERSION install script and every update script of sql/, nothing else" \
  "$(expected_files | paste -sd' ')" "$(paste -sd' ' <<<"$ext_members")"
for f in sql/pg_quota--*--*.sql; do
  check "the packaged $(basename "$f") is the one in sql/" cmp -s "$f" <(packaged "$EXTDIR/$(basename "$f")")
done
expect_eq "the packaged control file shows Cargo.toml's version" "default_version = '$VERSION'" \
  "$(packaged "$EXTDIR/pg_quota.control" | grep '^default_version')"
expect_eq "every file in the package belongs to root (0/0)" "" \
  "$(listing | awk '$2 != "0/0" { print $NF }' | paste -sd' ')"
if [ "$DEB" = 1 ]; then
  expect_eq "the package installs nothing outside $PKGLIBDIR, $EXTDIR and its doc folder" "" \
    "$(members | grep -v '/$' | grep -vE "^($PKGLIBDIR|$EXTDIR|/usr/share/doc/$NAME)/" | paste -sd' ')"
else
  expect_eq "the tarball holds nothing but the extension's files" "" \
    "$(members | grep -vxF "$ext_members" | paste -sd' ')"
fi
PKG_FILES="$(members | grep -v '/$' | sort)"

# --- take the cargo-pgrx install's pg_quota files away, and put them back at exit --------
# Outside SCRATCH, which scripts/test removes: if putting the files back fails, the
# backup the message names is still there.
BACKUP="$(mktemp -d /var/tmp/pg_quota-package-backup.XXXXXX)"
mapfile -t ORIG < <(pg_quota_files)
: > "$BACKUP/sha256"
if [ "${#ORIG[@]}" -gt 0 ]; then
  tar -cpf "$BACKUP/files.tar" -P "${ORIG[@]}"
  sha256sum "${ORIG[@]}" > "$BACKUP/sha256"
fi
log "backed up ${#ORIG[@]} pg_quota files of $PREFIX to $BACKUP"
INSTALLED=0
FIXTURE="$EXTDIR/pg_quota--0.1.0.sql"
FIXTURE_PLACED=0
RESTORED=0
RESTORE_RC=1

# remove_package: what the package put there goes again (dpkg -r, or the note's command).
remove_package() {
  if [ "$DEB" = 1 ]; then
    dpkg -r "$NAME" >&2
  else
    (cd "$PREFIX" && tar -tzf "$PKG" | xargs rm -f)
  fi
}
# restore: no package, no fixture, and exactly the files that were there before,
# byte-identical. Prints what is off; fails if anything is.
restore() {
  [ "$RESTORED" = 0 ] || return "$RESTORE_RC"
  RESTORED=1; RESTORE_RC=1
  local f ok=0
  [ "$FIXTURE_PLACED" = 0 ] || rm -f "$FIXTURE"
  if [ "$INSTALLED" = 1 ]; then remove_package || ok=1; INSTALLED=0; fi
  while read -r f; do rm -f "$f"; done < <(pg_quota_files)
  [ "${#ORIG[@]}" -eq 0 ] || tar -xpf "$BACKUP/files.tar" -P || ok=1
  [ ! -s "$BACKUP/sha256" ] || sha256sum --quiet -c "$BACKUP/sha256" >&2 || ok=1
  if [ "$(pg_quota_files)" != "$(printf '%s\n' "${ORIG[@]}" | sed '/^$/d' | sort)" ]; then
    echo "# pg_quota files now: $(pg_quota_files | paste -sd' ')"; ok=1
  fi
  RESTORE_RC=$ok
  return "$ok"
}
at_exit() {
  local rc=$?
  set +e
  for c in "${CLUSTERS[@]}"; do stop_cluster "$c" immediate; done
  if [ "$RESTORED" = 0 ]; then
    if restore; then log "restored the pg_quota files of $PREFIX"
    else log "RESTORING THE pg_quota FILES OF $PREFIX FAILED; the backup is $BACKUP/files.tar"; rc=1; fi
  fi
  (exit "$rc"); cleanup_at_exit
  [ "$RESTORE_RC" != 0 ] || rm -rf "$BACKUP"
  if [ "$rc" = 0 ]; then [ -z "$OWN_SCRATCH" ] || rm -rf "$OWN_SCRATCH"; fi
  return "$rc"
}
trap at_exit EXIT
trap 'exit 130' INT TERM HUP

while read -r f; do rm -f "$f"; done < <(pg_quota_files)
expect_eq "before the install, no pg_quota file is left in $WHERE" "" "$(pg_quota_files | paste -sd' ')"

# --- install -----------------------------------------------------------------------------
INSTALLED=1
if [ "$DEB" = 1 ]; then
  check "dpkg -i installs the package" to_err dpkg -i "$PKG"
  expect_eq "dpkg lists it as installed, at Cargo.toml's version" "install ok installed $VERSION" \
    "$(dpkg-query -W -f='${Status} ${Version}' "$NAME" 2>&1)"
  check "dpkg --verify finds its files as packaged" to_err dpkg --verify "$NAME"
  expect_eq "dpkg -L lists every file of the package" "$PKG_FILES" \
    "$(dpkg -L "$NAME" | while read -r f; do [ -d "$f" ] || echo "$f"; done | sort)"
else
  check "tar -xzf … -C $PREFIX installs the tarball" tar -xzf "$PKG" -C "$PREFIX"
fi
expect_eq "the pg_quota files in $WHERE are the package's, no others" "$(expected_files | paste -sd' ')" \
  "$(pg_quota_files | paste -sd' ')"

# --- use it --------------------------------------------------------------------------------
CL="$SCRATCH/package"
PORT="${PORT:-$((5480 + PORT_OFFSET))}"
rm -rf "$CL"; mkdir -p "$CL"; chown "$PG_USER" "$CL"
CLUSTERS+=("$CL")
start_cluster "$CL" "$PORT"
sql -c "CREATE ROLE t1 LOGIN" -c "ALTER ROLE t1 SET quota.max_active_per_role = 1" \
    -c "CREATE DATABASE fresh" -c "CREATE DATABASE old" >/dev/null
expect_eq "pg_available_extensions offers the packaged version" "$VERSION" \
  "$(sql -c "SELECT default_version FROM pg_available_extensions WHERE name = 'pg_quota'")"
ext_version() { sql -d "$1" -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'"; }
uuid_like() { [[ "$1" =~ ^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$ ]]; }
# start_refuse_finish DB: t1 (limit 1, holding nothing) is admitted, refused, frees its
# slot with finish() and is admitted again.
start_refuse_finish() {
  local db="$1" t
  t="$(as t1 "$db" "SELECT quota.start('packaged')")"
  check "$db: start() admits t1 ($t)" uuid_like "$t"
  expect_eq "$db: a second start() is refused with 53400" 53400 "$(state t1 "$db" "SELECT quota.start('one too many')")"
  expect_eq "$db: finish() ends the ticket" t "$(as t1 "$db" "SELECT quota.finish('$t')")"
  t="$(as t1 "$db" "SELECT quota.start('after finish')")"
  check "$db: start() admits t1 again once the slot is free" uuid_like "$t"
  expect_eq "$db: and that ticket finishes too" t "$(as t1 "$db" "SELECT quota.finish('$t')")"
}

check "CREATE EXTENSION pg_quota works from the packaged files" sql -d fresh -c "CREATE EXTENSION pg_quota"
expect_eq "it installs the packaged version" "$VERSION" "$(ext_version fresh)"
start_refuse_finish fresh

# A database made with an older package: the frozen 0.1.0 install script stands in for it.
cp tests/upgrade/pg_quota--0.1.0.sql "$FIXTURE"; FIXTURE_PLACED=1
check "a database is created at 0.1.0 (the frozen script)" sql -d old -c "CREATE EXTENSION pg_quota VERSION '0.1.0'"
old_ticket="$(as t1 old "SELECT quota.start('made at 0.1.0')")"
check "a database at 0.1.0 holds a ticket of t1 ($old_ticket)" uuid_like "$old_ticket"
rm -f "$FIXTURE"; FIXTURE_PLACED=0
expect_eq "the 0.1.0 database stands; only the package's files are in $WHERE" "0.1.0 $(expected_files | paste -sd' ')" \
  "$(ext_version old) $(pg_quota_files | paste -sd' ')"
rc=0; out="$(sql -d old -c "ALTER EXTENSION pg_quota UPDATE" 2>&1)" || rc=$?
check "ALTER EXTENSION pg_quota UPDATE from 0.1.0 works from the packaged files${out:+: ${out//$'\n'/ }}" test "$rc" = 0
expect_eq "the database is at the packaged version" "$VERSION" "$(ext_version old)"
expect_eq "the 0.1.0 ticket is still active and t1's" "t1 active" \
  "$(sql -d old -c "SELECT role::regrole || ' ' || CASE WHEN ended_at IS NULL THEN 'active' ELSE 'ended' END FROM quota.ledger WHERE id = '$old_ticket'")"
expect_eq "old: it still holds t1's slot (53400)" 53400 "$(state t1 old "SELECT quota.start('while 0.1.0 holds it')")"
expect_eq "old: finish() ends the 0.1.0 ticket" t "$(as t1 old "SELECT quota.finish('$old_ticket')")"
start_refuse_finish old
stop_cluster "$CL"

# --- remove ------------------------------------------------------------------------------
# INSTALLED stays 1 if the removal failed, so that the EXIT trap tries it again.
if remove_package; then INSTALLED=0; fi
check "the package is removed ($([ "$DEB" = 1 ] && echo "dpkg -r" || echo "the note's tar -tzf … | xargs rm -f"))" \
  test "$INSTALLED" = 0
expect_eq "none of the package's files is left" "" \
  "$(while read -r f; do [ ! -e "$f" ] || echo "$f"; done <<<"$PKG_FILES" | paste -sd' ')"
expect_eq "no pg_quota file is left in $WHERE" "" "$(pg_quota_files | paste -sd' ')"
if [ "$DEB" = 1 ]; then
  # It has no conffiles, so dpkg -r leaves no "config-files" entry behind: it is gone.
  expect_eq "dpkg no longer lists $NAME" "" "$(dpkg-query -W -f='${Status}' "$NAME" 2>/dev/null || true)"
  check "its doc folder is gone" test ! -e "/usr/share/doc/$NAME"
fi
check "the ${#ORIG[@]} pg_quota files that were in $WHERE are back, byte-identical" restore
finish_checks
