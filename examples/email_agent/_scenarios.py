"""The threads of one synthetic inbox: fact threads (each with the question it answers) and noise threads.

A fact scenario claims a key (a project's meeting, a vendor's invoice, a trip to a city...) that no other
question in the corpus uses, writes one to three emails, and returns the question drafted from them.
Noise threads (newsletters, office chatter, project status notes) share vocabulary with the facts so that
keyword search has to be used with some care. Everything draws from one seeded `random.Random`.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta

from examples.email_agent import _vocabulary as vocab
from examples.email_agent.records import Email, QuestionKind

MAX_INBOXES = len(vocab.COMPANIES)
PROJECTS_PER_INBOX = 5
VENDORS_PER_INBOX = 14
CITIES_PER_INBOX = 4
YEAR_START = datetime(2024, 1, 2, 8, 0)
YEAR_DAYS = 355
FACT_THREAD_PROBABILITY = 0.35


# -------------------------------------------------------------------------------------------- people


@dataclass(frozen=True)
class Person:
    name: str
    addr: str
    role: str

    @property
    def first(self) -> str:
        return self.name.split()[0]


class Pools:
    """Entities drawn without replacement across the whole corpus: no two questions share their text."""

    def __init__(self, rng: random.Random) -> None:
        self.names = [f"{first} {last}" for first in vocab.FIRST_NAMES for last in vocab.LAST_NAMES]
        self.cities = list(vocab.CITIES)
        self.vendors = [f"{p} {s}" for p in vocab.VENDOR_PREFIXES for s in vocab.VENDOR_SUFFIXES]
        for pool in (self.names, self.cities, self.vendors):
            rng.shuffle(pool)

    def name(self) -> str:
        return self.names.pop()

    def person(self, domain: str, role: str) -> Person:
        name = self.name()
        return Person(name, f"{name.lower().replace(' ', '.')}@{domain}", role)


def draw_companies_and_projects(
    rng: random.Random, inboxes: int
) -> tuple[list[tuple[str, str]], list[list[str]]]:
    companies = rng.sample(vocab.COMPANIES, inboxes)
    projects = rng.sample(vocab.PROJECTS, inboxes * PROJECTS_PER_INBOX)
    return companies, [projects[i::inboxes] for i in range(inboxes)]


@dataclass
class InboxWorld:
    owner: Person
    manager: Person
    colleagues: list[Person]
    recruiter: Person
    finance: Person
    company: str
    domain: str
    projects: list[str]
    vendors: list[str]
    id_prefix: str

    @classmethod
    def create(
        cls, rng: random.Random, pools: Pools, company: str, domain: str, projects: list[str], index: int
    ) -> InboxWorld:
        owner = pools.person(domain, rng.choice(vocab.ROLES))
        return cls(
            owner=owner,
            manager=pools.person(domain, rng.choice(vocab.MANAGER_ROLES)),
            colleagues=[pools.person(domain, rng.choice(vocab.ROLES)) for _ in range(9)],
            recruiter=pools.person(domain, "Recruiter"),
            finance=pools.person(domain, "Finance Analyst"),
            company=company,
            domain=domain,
            projects=projects,
            vendors=[pools.vendors.pop() for _ in range(VENDORS_PER_INBOX)],
            id_prefix=f"{owner.name.split()[0][0]}{owner.name.split()[1][0]}{index}".lower(),
        )


# ----------------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class QuestionDraft:
    inbox: str
    question: str
    answer: str
    aliases: tuple[str, ...]
    sources: tuple[Email, ...]
    kind: QuestionKind


@dataclass
class Mailbox:
    """Assigns message ids and collects the emails of one inbox."""

    inbox: str
    id_prefix: str
    emails: list[Email] = field(default_factory=list)

    def send(
        self,
        sender: Person | str,
        to: Sequence[Person | str],
        subject: str,
        body: str,
        at: datetime,
        *,
        cc: Sequence[Person | str] = (),
        attachments: Sequence[str] = (),
        reply_to: Email | None = None,
    ) -> Email:
        message_id = f"{self.id_prefix}{len(self.emails) + 1:04d}"
        email = Email(
            message_id=message_id,
            inbox=self.inbox,
            from_addr=_addr(sender),
            to_addrs=tuple(_addr(p) for p in to),
            cc=tuple(_addr(p) for p in cc),
            subject=subject,
            body=body,
            sent_at=at.isoformat(timespec="seconds"),
            thread_id=reply_to.thread_id if reply_to else message_id,
            in_reply_to=reply_to.message_id if reply_to else None,
            attachments=tuple(attachments),
        )
        self.emails.append(email)
        return email


def _addr(person: Person | str) -> str:
    return person.addr if isinstance(person, Person) else person


def _reply_subject(subject: str) -> str:
    return subject if subject.startswith("Re: ") else f"Re: {subject}"


def _day(d: date) -> str:
    return f"{d:%A}, {d:%B} {d.day}"  # "Thursday, March 14"


def _date(d: date) -> str:
    return f"{d:%B} {d.day}"  # "March 14": the form answers use


def _amount(value: float) -> str:
    return f"${value:,.2f}"


class _Writer:
    """Writes the threads of one inbox. Fact methods return a QuestionDraft, or None when out of keys."""

    def __init__(self, world: InboxWorld, rng: random.Random, pools: Pools) -> None:
        self.w = world
        self.rng = rng
        self.pools = pools
        self.mail = Mailbox(world.owner.addr, world.id_prefix)
        self.used_keys: set[tuple[str, ...]] = set()
        self.cities = [pools.cities.pop() for _ in range(CITIES_PER_INBOX)]

    # ----------------------------------------------------------------------------------- helpers

    def _claim(self, candidates: list[tuple[str, ...]]) -> tuple[str, ...] | None:
        free = [k for k in candidates if k not in self.used_keys]
        if not free:
            return None
        key = self.rng.choice(free)
        self.used_keys.add(key)
        return key

    def _when(self) -> datetime:
        day = YEAR_START + timedelta(days=self.rng.randrange(YEAR_DAYS))
        while day.weekday() >= 5:
            day += timedelta(days=1)
        return day.replace(hour=self.rng.randint(8, 17), minute=self.rng.randrange(0, 60, 5))

    def _later(self, at: datetime, min_minutes: int = 10, max_minutes: int = 600) -> datetime:
        return at + timedelta(minutes=self.rng.randint(min_minutes, max_minutes))

    def _workday_after(self, at: datetime, min_days: int, max_days: int) -> date:
        d = (at + timedelta(days=self.rng.randint(min_days, max_days))).date()
        while d.weekday() >= 5:
            d += timedelta(days=1)
        return d

    def _body(self, to: Person | None, sender: Person | str, lines: Sequence[str], *, sign: bool = True) -> str:
        parts = []
        if to is not None:
            parts.append(self.rng.choice(vocab.GREETINGS).format(first=to.first))
        text = " ".join(lines)
        if self.rng.random() < 0.5:
            text += " " + self.rng.choice(vocab.FILLER)
        parts.append(text)
        if sign and isinstance(sender, Person):
            parts.append(f"{self.rng.choice(vocab.SIGN_OFFS)}\n{sender.first}")
        return "\n\n".join(parts)

    def _colleague(self, *exclude: Person) -> Person:
        return self.rng.choice([c for c in self.w.colleagues if c not in exclude])

    def _kind(self, weights: dict[QuestionKind, int]) -> QuestionKind:
        kinds = list(weights)
        return self.rng.choices(kinds, weights=[weights[k] for k in kinds])[0]

    def _draft(self, question: str, answer: str, sources: Sequence[Email], kind: QuestionKind,
               aliases: Sequence[str] = ()) -> QuestionDraft:
        return QuestionDraft(self.w.owner.addr, question, answer, tuple(aliases), tuple(sources), kind)

    # ------------------------------------------------------------------------------------- facts

    def meeting(self) -> QuestionDraft | None:
        key = self._claim([("meeting", p, m) for p in self.w.projects for m in vocab.MEETING_TYPES])
        if key is None:
            return None
        _, project, mtype = key
        at = self._when()
        organizer = self.rng.choice([*self.w.colleagues, self.w.manager])
        attendees = [self.w.owner, self._colleague(organizer)]
        day = self._workday_after(at, 1, 12)
        time, room = self.rng.choice(vocab.MEETING_TIMES), self.rng.choice(vocab.ROOMS)
        kind = self._kind({"subject": 4, "body": 4, "thread": 2})
        if kind == "subject":
            subject = self.rng.choice([f"{project} {mtype} moved to {time}", f"{project} {mtype}: {day:%A} at {time}"])
            lines = [f"Quick update: the {project} {mtype} is now on {_day(day)} at {time} in {room}."]
            email = self.mail.send(organizer, attendees, subject, self._body(None, organizer, lines), at)
            question = self.rng.choice([f"What time is the {project} {mtype}?",
                                        f"What time does the {project} {mtype} start?"])
            return self._draft(question, time, [email], "subject")
        subject = self.rng.choice([f"Invite: {project} {mtype}", f"{project} {mtype}"])
        lines = [f"I'm setting up the {project} {mtype} for {_day(day)} at {time} in {room}.",
                 "Please bring your updates and any open questions."]
        invite = self.mail.send(organizer, attendees, subject, self._body(None, organizer, lines), at)
        if kind == "body":
            fact = self.rng.choice(["room", "date", "time"])
            if fact == "room":
                return self._draft(f"Which room is the {project} {mtype} in?", room, [invite], "body")
            if fact == "date":
                return self._draft(f"What date is the {project} {mtype}?", _date(day), [invite], "body")
            return self._draft(f"What time is the {project} {mtype} scheduled for?", time, [invite], "body")
        new_time = self.rng.choice([t for t in vocab.MEETING_TIMES if t != time])
        asker = attendees[1]
        ask_at = self._later(at)
        ask = self.mail.send(asker, [organizer], _reply_subject(subject), self._body(
            organizer, asker, [f"I have a conflict at {time}. Could we move the {mtype} to {new_time}?"]),
            ask_at, cc=[self.w.owner], reply_to=invite)
        confirm = self.mail.send(organizer, [asker, self.w.owner], _reply_subject(subject), self._body(
            None, organizer, [f"Sure, the {project} {mtype} is moved to {new_time} on {_day(day)}.",
                              "I've updated the invite."]), self._later(ask_at), reply_to=ask)
        return self._draft(f"What time was the {project} {mtype} moved to?", new_time, [ask, confirm], "thread")

    def invoice(self) -> QuestionDraft | None:
        key = self._claim([("invoice", v) for v in self.w.vendors])
        if key is None:
            return None
        vendor = key[1]
        billing = f"billing@{vendor.lower().replace(' ', '')}.com"
        at = self._when()
        number = f"INV-{self.rng.randint(10000, 99999)}"
        amount = _amount(self.rng.randint(300, 48000) + self.rng.choice([0, 0, 0.5, 0.25, 0.99]))
        due = self._workday_after(at, 14, 30)
        kind = self._kind({"subject": 3, "body": 4, "thread": 2})
        subject = f"Invoice {number} from {vendor}" + (f" - {amount}" if kind == "subject" else "")
        lines = [f"Please find attached invoice {number} for {amount}, due by {_day(due)}.",
                 "Payment by bank transfer is preferred."]
        bill = self.mail.send(billing, [self.w.owner], subject, self._body(self.w.owner, f"{vendor} Billing", lines)
                              + f"\n\n{vendor} Billing", at, attachments=[f"{number}.pdf"])
        if kind == "subject":
            return self._draft(f"How much is the invoice from {vendor}?", amount, [bill], "subject")
        if kind == "body":
            if self.rng.random() < 0.5:
                return self._draft(f"How much do we owe {vendor} on their invoice?", amount, [bill], "body")
            return self._draft(f"When is the {vendor} invoice due?", _date(due), [bill], "body")
        fwd_at = self._later(at)
        fwd = self.mail.send(self.w.owner, [self.w.finance], f"Fwd: {subject}", self._body(
            self.w.finance, self.w.owner, [f"Could you process the {vendor} invoice below?"]), fwd_at,
            attachments=[f"{number}.pdf"], reply_to=bill)
        reference = f"PAY-{self.rng.randint(100000, 999999)}"
        paid = self.mail.send(self.w.finance, [self.w.owner], _reply_subject(fwd.subject), self._body(
            self.w.owner, self.w.finance, [f"Paid the {vendor} invoice today by wire transfer.",
                                           f"The payment reference is {reference}."]),
            self._later(fwd_at, 60, 2000), reply_to=fwd)
        return self._draft(f"What is the payment reference for the {vendor} invoice?", reference, [paid], "thread")

    def decision(self) -> QuestionDraft | None:
        key = self._claim([("decision", p, t) for p in self.w.projects for t in vocab.DECISION_TOPICS])
        if key is None:
            return None
        _, project, topic = key
        options = self.rng.sample(self.w.vendors, 3)
        chosen = self.rng.choice(options)
        at = self._when()
        manager, proposer = self.w.manager, self._colleague()
        question = self.rng.choice([f"Which vendor was chosen for the {project} {topic} work?",
                                    f"Who did we pick for the {project} {topic} work?"])
        kind = self._kind({"subject": 3, "body": 3, "thread": 3})
        if kind == "subject":
            email = self.mail.send(manager, [self.w.owner, proposer], f"Decision: {chosen} for {project} {topic}",
                                   self._body(None, manager, [
                                       f"After comparing the bids we're going with {chosen} for {topic} on {project}.",
                                       "Contracts will follow next week."]), at)
            return self._draft(question, chosen, [email], "subject")
        if kind == "body":
            email = self.mail.send(manager, [self.w.owner], f"{project} {topic} update", self._body(
                self.w.owner, manager, [f"We signed with {chosen} for the {topic} work on {project}.",
                                        "They start at the beginning of next month."]), at)
            return self._draft(question, chosen, [email], "body")
        prices = [_amount(self.rng.randrange(5000, 90000, 500)) for _ in options]
        bids = ", ".join(f"{o} ({p})" for o, p in zip(options[:-1], prices, strict=False))
        proposal = self.mail.send(proposer, [manager], f"{project} {topic} vendor options", self._body(
            manager, proposer, [f"We have three bids for {topic} on {project}: {bids} and {options[-1]} ({prices[-1]}).",
                                "Which one should we go with?"]), at, cc=[self.w.owner])
        reply = self.mail.send(manager, [proposer], _reply_subject(proposal.subject), self._body(
            proposer, manager, [f"Let's go with {chosen}.", "Their references were the strongest."]),
            self._later(at, 60, 2000), cc=[self.w.owner], reply_to=proposal)
        return self._draft(question, chosen, [proposal, reply], "thread")

    def budget(self) -> QuestionDraft | None:
        key = self._claim([("budget", p, q) for p in self.w.projects for q in vocab.QUARTERS])
        if key is None:
            return None
        _, project, quarter = key
        approved = self.rng.randrange(20000, 400000, 2500)
        requested = approved + self.rng.randrange(5000, 60000, 2500)
        amount, at = _amount(approved), self._when()
        question = f"How much budget was approved for {project} in {quarter}?"
        if self._kind({"subject": 1, "body": 1}) == "subject":
            email = self.mail.send(self.w.finance, [self.w.owner], f"{project} {quarter} budget approved: {amount}",
                                   self._body(self.w.owner, self.w.finance, [
                                       f"Good news: finance approved {amount} for {project} in {quarter}."]), at)
            return self._draft(question, amount, [email], "subject")
        email = self.mail.send(self.w.finance, [self.w.owner], f"{project} {quarter} budget", self._body(
            self.w.owner, self.w.finance, [f"Finance approved {amount} for {project} in {quarter},",
                                           f"less than the {_amount(requested)} we asked for."]), at)
        return self._draft(question, amount, [email], "body")

    def deadline(self) -> QuestionDraft | None:
        key = self._claim([("deadline", p, d) for p in self.w.projects for d in vocab.DELIVERABLES])
        if key is None:
            return None
        _, project, deliverable = key
        at = self._when()
        due = self._workday_after(at, 7, 40)
        manager = self.w.manager
        kind = self._kind({"subject": 3, "body": 3, "thread": 2})
        if kind == "subject":
            email = self.mail.send(manager, [self.w.owner], f"{project} {deliverable} due {_date(due)}", self._body(
                self.w.owner, manager, [f"The {project} {deliverable} is due on {_day(due)}."]), at)
            return self._draft(f"When is the {project} {deliverable} due?", _date(due), [email], "subject")
        if kind == "body":
            email = self.mail.send(manager, [self.w.owner], f"Timeline for the {project} {deliverable}", self._body(
                self.w.owner, manager, [f"The {deliverable} is due on {_day(due)}.",
                                        "Reviews start the week before."]), at)
            return self._draft(f"When is the {project} {deliverable} due?", _date(due), [email], "body")
        later = self._workday_after(datetime.combine(due, at.time()), 3, 10)
        ask = self.mail.send(self.w.owner, [manager], f"{project} {deliverable} date", self._body(
            manager, self.w.owner, [f"Can we commit to {_date(due)} for the {project} {deliverable}?"]), at)
        counter_at = self._later(at, 30, 900)
        counter = self.mail.send(manager, [self.w.owner], _reply_subject(ask.subject), self._body(
            self.w.owner, manager, [f"{_date(due)} is too tight. Let's make it {_date(later)}."]), counter_at, reply_to=ask)
        agreed = self.mail.send(self.w.owner, [manager], _reply_subject(ask.subject), self._body(
            None, self.w.owner, [f"Works for me, {_date(later)} it is."]), self._later(counter_at), reply_to=counter)
        return self._draft(f"What is the agreed due date for the {project} {deliverable}?", _date(later),
                           [counter, agreed], "thread")

    def travel(self) -> QuestionDraft | None:
        if not self.cities:
            return None
        city = self.cities.pop()
        at = self._when()
        agency = "trips@skywaytravel.com"
        flight = f"{self.rng.choice(vocab.AIRLINES)} {self.rng.randint(100, 999)}"
        code = "".join(self.rng.choices(string.ascii_uppercase + string.digits, k=6))
        departs, day = self.rng.choice(vocab.FLIGHT_TIMES), self._workday_after(at, 5, 40)
        hotel = self.rng.choice(vocab.HOTELS)
        lines = [f"Your flight {flight} from {self.rng.choice(vocab.HOME_AIRPORTS)} to {city} departs at {departs}"
                 f" on {_day(day)}.", f"Confirmation code: {code}.", f"Hotel: {hotel}, 3 nights."]
        body = self._body(self.w.owner, agency, lines) + "\n\nSkyway Travel"
        if self._kind({"subject": 1, "body": 3}) == "subject":
            email = self.mail.send(agency, [self.w.owner], f"Flight {flight} to {city} confirmed", body, at)
            return self._draft(f"What is my flight number for the trip to {city}?", flight, [email], "subject",
                               aliases=[flight.replace(" ", "")])
        email = self.mail.send(agency, [self.w.owner], f"Trip confirmation: {city}", body, at)
        fact = self.rng.choice(["code", "time", "hotel"])
        if fact == "code":
            return self._draft(f"What is the confirmation code for my trip to {city}?", code, [email], "body")
        if fact == "time":
            return self._draft(f"What time does my flight to {city} depart?", departs, [email], "body")
        return self._draft(f"Which hotel am I staying at in {city}?", hotel, [email], "body")

    def attachment(self) -> QuestionDraft | None:
        key = self._claim([("attachment", p, d) for p in self.w.projects for d in vocab.DOCUMENTS])
        if key is None:
            return None
        _, project, document = key
        version = self.rng.randint(2, 9)
        extension = {"pricing sheet": "xlsx", "roadmap deck": "pptx"}.get(document, "pdf")
        file = f"{project.lower()}_{document.replace(' ', '_')}_v{version}.{extension}"
        sender, at = self._colleague(), self._when()
        comments_by = self._workday_after(at, 2, 9)
        lines = [f"Attached is version {version} of the {project} {document} ({file}).",
                 f"Comments by {_day(comments_by)} please."]
        if self._kind({"subject": 1, "body": 2}) == "subject":
            email = self.mail.send(sender, [self.w.owner], f"{project} {document} v{version} attached",
                                   self._body(self.w.owner, sender, lines), at, attachments=[file])
            return self._draft(f"Which version of the {project} {document} did {sender.name} send?", f"v{version}",
                               [email], "subject", aliases=[f"version {version}"])
        email = self.mail.send(sender, [self.w.owner], f"{project} {document}", self._body(self.w.owner, sender, lines),
                               at, attachments=[file])
        return self._draft(f"What is the file name of the {project} {document}?", file, [email], "body")

    def phone(self) -> QuestionDraft | None:
        key = self._claim([("phone", c.name) for c in self.w.colleagues])
        if key is None:
            return None
        person = next(c for c in self.w.colleagues if c.name == key[1])
        number = f"{self.rng.randint(201, 989)}-555-{self.rng.randint(0, 9999):04d}"
        at = self._when()
        question = f"What is {person.name}'s new phone number?"
        aliases = [number.replace("-", "")]
        lines = [f"I switched carriers, so my new cell number is {number}.", "The old one stops working on Friday."]
        if self._kind({"subject": 1, "body": 2}) == "subject":
            email = self.mail.send(person, [self.w.owner], f"My new number: {number}",
                                   self._body(self.w.owner, person, lines), at)
            return self._draft(question, number, [email], "subject", aliases)
        email = self.mail.send(person, [self.w.owner], "New phone number", self._body(self.w.owner, person, lines), at)
        return self._draft(question, number, [email], "body", aliases)

    def interview(self) -> QuestionDraft | None:
        candidate = self.pools.name()
        role = self.rng.choice(vocab.CANDIDATE_ROLES)
        at = self._when()
        day, time = self._workday_after(at, 2, 15), self.rng.choice(vocab.MEETING_TIMES)
        email = self.mail.send(self.w.recruiter, [self.w.owner], f"Interview: {candidate} for {role}", self._body(
            self.w.owner, self.w.recruiter, [f"You're interviewing {candidate} for the {role} role on {_day(day)} at"
                                             f" {time}.", "Their resume is attached."]),
            at, attachments=[f"{candidate.replace(' ', '_')}_resume.pdf"])
        if self.rng.random() < 0.5:
            return self._draft(f"What time is the interview with {candidate}?", time, [email], "body")
        return self._draft(f"What day is my interview with {candidate}?", _date(day), [email], "body")

    def order(self) -> QuestionDraft | None:
        number = str(self.rng.randint(100000, 999999))
        if ("order", number) in self.used_keys:
            return None
        self.used_keys.add(("order", number))
        shop = self.rng.choice(["orders@deskpro.shop", "orders@officehub.com", "ship@gadgetcorner.com"])
        tracking = f"TRK-{self.rng.randint(100000, 999999)}"
        email = self.mail.send(shop, [self.w.owner], f"Your order #{number} has shipped", self._body(
            self.w.owner, shop, [f"Good news, order #{number} is on its way.", f"Tracking number: {tracking}.",
                                 "Delivery usually takes 3 to 5 business days."]), self._when())
        return self._draft(f"What is the tracking number for order {number}?", tracking, [email], "body")

    # ------------------------------------------------------------------------------------- noise

    def newsletter(self) -> None:
        sender, title = self.rng.choice(vocab.NEWSLETTER_SENDERS)
        topic = self.rng.choice(vocab.NEWSLETTER_TOPICS)
        body = self._body(None, sender, [
            f"This week in {title}: what {topic} means for teams like yours.",
            f"Plus: three charts on {self.rng.choice(vocab.NEWSLETTER_TOPICS)} and a reader Q&A.",
            "Unsubscribe at any time from your preferences page."], sign=False)
        self.mail.send(sender, [self.w.owner], f"{title}: {topic} this week", body, self._when())

    def social(self) -> None:
        subject, text = self.rng.choice(vocab.SOCIAL_SUBJECTS)
        sender = self._colleague()
        at = self._when()
        first = self.mail.send(sender, [self.w.owner, self._colleague(sender)], subject,
                               self._body(None, sender, [text]), at)
        if self.rng.random() < 0.5:
            self.mail.send(self.w.owner, [sender], _reply_subject(subject), self._body(
                sender, self.w.owner, [self.rng.choice(["Count me in!", "Sounds great.", "Thanks for the heads up."])]),
                self._later(at), reply_to=first)

    def it_notice(self) -> None:
        subject, text = self.rng.choice(vocab.IT_NOTICES)
        self.mail.send(f"it@{self.w.domain}", [f"all@{self.w.domain}"], subject,
                       self._body(None, "IT", [text]) + "\n\nIT Support", self._when())

    def status(self) -> None:
        project = self.rng.choice(self.w.projects)
        sender = self._colleague()
        lines = [*self.rng.sample(vocab.STATUS_LINES, 2),
                 f"Next up is the {project} {self.rng.choice(vocab.MEETING_TYPES)}."]
        at = self._when()
        update = self.mail.send(sender, [self.w.owner], f"{project} status update",
                                self._body(self.w.owner, sender, lines), at, cc=[self.w.manager])
        if self.rng.random() < 0.3:
            self.mail.send(self.w.manager, [sender], _reply_subject(update.subject), self._body(
                sender, self.w.manager, ["Thanks, this is helpful."]), self._later(at), cc=[self.w.owner],
                reply_to=update)

    def meeting_notes(self) -> None:
        project, mtype = self.rng.choice(self.w.projects), self.rng.choice(vocab.MEETING_TYPES)
        sender = self._colleague()
        self.mail.send(sender, [self.w.owner, self.w.manager], f"Notes: {project} {mtype}", self._body(
            None, sender, [f"Notes from today's {project} {mtype}:", self.rng.choice(vocab.STATUS_LINES),
                           "Action items are in the tracker."]), self._when())

    def vendor_marketing(self) -> None:
        vendor = self.rng.choice(self.w.vendors)
        sender = f"news@{vendor.lower().replace(' ', '')}.com"
        self.mail.send(sender, [self.w.owner], f"What's new at {vendor}", self._body(
            self.w.owner, sender, [f"{vendor} now offers faster onboarding and a new customer portal.",
                                   "Reply to book a demo with our team."], sign=False), self._when())


FACTS: tuple[tuple[Callable[[_Writer], QuestionDraft | None], int], ...] = (
    (_Writer.meeting, 4), (_Writer.invoice, 2), (_Writer.decision, 2), (_Writer.budget, 1),
    (_Writer.deadline, 2), (_Writer.travel, 1), (_Writer.attachment, 1), (_Writer.phone, 1),
    (_Writer.interview, 1), (_Writer.order, 1),
)
NOISE: tuple[tuple[Callable[[_Writer], None], int], ...] = (
    (_Writer.newsletter, 3), (_Writer.social, 3), (_Writer.it_notice, 1), (_Writer.status, 3),
    (_Writer.meeting_notes, 2), (_Writer.vendor_marketing, 1),
)


def write_inbox(
    world: InboxWorld, rng: random.Random, pools: Pools, emails_per_inbox: int
) -> tuple[list[Email], list[QuestionDraft]]:
    """Threads until the inbox holds at least `emails_per_inbox` emails, then sorted by time."""
    writer = _Writer(world, rng, pools)
    drafts: list[QuestionDraft] = []
    fact_makers, fact_weights = zip(*FACTS, strict=True)
    noise_makers, noise_weights = zip(*NOISE, strict=True)
    while len(writer.mail.emails) < emails_per_inbox:
        if rng.random() < FACT_THREAD_PROBABILITY:
            draft = rng.choices(fact_makers, weights=fact_weights)[0](writer)
            if draft is not None:
                drafts.append(draft)
                continue
        rng.choices(noise_makers, weights=noise_weights)[0](writer)
    emails = sorted(writer.mail.emails, key=lambda e: (e.sent_at, e.message_id))
    return emails, drafts
