"""Basic-auth password checks: bcrypt, remembered by digest, shared out fairly among clients, and
as costly for a user that does not exist as for a wrong password."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter, OrderedDict

from kepler_bridge.http.fair_share import FairShare, address_key
from kepler_bridge.log_limit import EveryInterval

log = logging.getLogger(__name__)

# Checks at once: bcrypt releases the GIL, so each takes a core.
BCRYPT_SLOTS = 2
# A check waits this long for a slot, then is answered 503 (well inside a 10 s scrape timeout).
WAIT_SECONDS = 5.0
# bcrypt reads 72 bytes of a password at most, and refuses a longer one.
MAX_PASSWORD_BYTES = 72
# Results remembered, right and wrong apart: wrong guesses cannot push a right password out.
CACHE_ENTRIES = 1024


class _Remembered:
    """The last CACHE_ENTRIES results of one kind, by digest."""

    def __init__(self) -> None:
        self._digests: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        if digest not in self._digests:
            return False
        self._digests.move_to_end(digest)
        return True

    def add(self, digest: bytes) -> None:
        self._digests[digest] = None
        while len(self._digests) > CACHE_ENTRIES:
            self._digests.popitem(last=False)


class PasswordCheck:
    """bcrypt verification of a user's password, remembered by a digest of (user, hash,
    password): a known pair costs one lookup."""

    def __init__(self) -> None:
        self._right, self._wrong = _Remembered(), _Remembered()
        self._lock = threading.Lock()
        self._share = FairShare(BCRYPT_SLOTS, WAIT_SECONDS)
        self._dummy: tuple[dict[str, bytes], bytes] | None = None
        self._too_long = EveryInterval(
            log,
            "basic auth: a password over %d bytes was refused with 401 (bcrypt checks at most "
            "%d); a scraper that sends it needs a shorter password",
        )
        self._uncheckable = EveryInterval(
            log,
            "basic auth: bcrypt cannot check a password of user %r (%s), refused with 401; "
            "replace the user's hash (htpasswd -nBC 10 '' | tr -d ':\\n')",
        )
        self._busy = EveryInterval(
            log,
            "basic auth: a password check from %s was answered 503: that address has a check of "
            "the same user name running, or its share of the %d bcrypt slots while other "
            "addresses are clients, or waited %.0f s; someone there is guessing passwords",
        )
        self.verifications = 0

    def check(
        self, users: dict[str, bytes], user: str, password: bytes, client: str | None = ""
    ) -> bool | None:
        """True or False; None when the check could not run now (answer 503): `client` (its
        address) has a check of this user running, more than its share, or no slot came free."""
        address = address_key(client)
        self._share.seen(address)
        if len(password) > MAX_PASSWORD_BYTES:
            self._too_long.warning(MAX_PASSWORD_BYTES, MAX_PASSWORD_BYTES)
            return False
        # A user that does not exist is checked against a hash of the same cost: the same work.
        hashed = users.get(user) or self._dummy_hash(users)
        digest = hashlib.sha256(b"\0".join((user.encode(), hashed, password))).digest()
        with self._lock:
            if digest in self._right:
                return True
            if digest in self._wrong:
                return False
        with self._share.slot(address, user) as admitted:
            if not admitted:
                self._busy.warning(address or "a local socket", BCRYPT_SLOTS, WAIT_SECONDS)
                return None
            valid = self._bcrypt(user, password, hashed) and user in users
        with self._lock:
            (self._right if valid else self._wrong).add(digest)
        return valid

    def _bcrypt(self, user: str, password: bytes, hashed: bytes) -> bool:
        import bcrypt

        with self._lock:
            self.verifications += 1
        try:
            return bcrypt.checkpw(password, hashed)
        except ValueError as err:  # a hash that passed the start-up check but not bcrypt
            self._uncheckable.warning(user, err)
            return False

    def _dummy_hash(self, users: dict[str, bytes]) -> bytes:
        """A hash no password matches, at the cost most users' hashes have."""
        import bcrypt

        dummy = self._dummy
        if dummy is None or dummy[0] is not users:
            # "$2y$10$...": the cost is the two digits after the second "$".
            cost = Counter(hashed[4:6] for hashed in users.values()).most_common(1)[0][0]
            dummy = (users, bcrypt.gensalt(int(cost)) + b"." * 31)
            self._dummy = dummy
        return dummy[1]
