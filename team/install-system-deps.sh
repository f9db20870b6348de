#!/usr/bin/env bash
# The Debian packages team mode and its tests need, installed when missing: PostgreSQL (initdb, pg_ctl, postgres),
# and iproute2 (`ip netns`, for the multi-host tests' hosts). `.ci/run` and `make system-deps` run this as root.
# The package's own cluster is not started: the team backend runs a throwaway cluster of its own under .team/.
set -euo pipefail
missing=()
if ! command -v initdb >/dev/null && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  missing+=(postgresql)
fi
if ! command -v ip >/dev/null; then
  missing+=(iproute2)
fi
if [ ${#missing[@]} = 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "error: ${missing[*]} not installed: run \`sudo apt-get install ${missing[*]}\` (or this script as root)" >&2
  exit 2
fi
# policy-rc.d exit 101: Debian's convention for "start no service while packages install".
created_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && created_policy=1
fi
trap '[ "$created_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
