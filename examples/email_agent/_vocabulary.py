"""Word lists the synthetic inboxes are built from. Plain data; the generator draws from them with a seeded RNG.

Entity names that key a question (projects, vendors, cities, people) are drawn without replacement across
the whole corpus, so no two questions share their text.
"""

FIRST_NAMES = (
    "Alice", "Ben", "Carla", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonah", "Keiko", "Liam",
    "Maya", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Samir", "Tara", "Umar", "Vera", "Wes", "Ximena",
    "Yusuf", "Zoe", "Aaron", "Bianca", "Caleb", "Daria", "Emeka", "Fiona", "Gabriel", "Hana", "Ivan",
    "Julia", "Kofi", "Lena", "Marco", "Nora", "Oscar", "Paula", "Rafael", "Sofia", "Theo", "Uma", "Victor",
    "Wendy", "Yara", "Zane", "Amir", "Beatriz", "Colin", "Dana", "Erik", "Freya", "Gideon", "Helen",
)
LAST_NAMES = (
    "Chen", "Okafor", "Lindqvist", "Moreau", "Patel", "Novak", "Haddad", "Tanaka", "Rossi", "Fischer",
    "Alvarez", "Kowalski", "Nguyen", "Schmidt", "Osei", "Brennan", "Ivanova", "Costa", "Dubois", "Yamamoto",
    "Larsen", "Mensah", "Petrov", "Romero", "Sato", "Walsh", "Zhang", "Bauer", "Castillo", "Dimitrov",
    "Eriksen", "Farah", "Gallagher", "Horvat", "Iyer", "Jansen", "Kim", "Lopez", "Murphy", "Nakamura",
)

ROLES = (
    "Product Manager", "Engineering Manager", "Software Engineer", "Data Scientist", "Designer",
    "Finance Analyst", "Operations Lead", "Account Executive", "Recruiter", "Legal Counsel",
    "QA Engineer", "Marketing Manager", "Customer Success Lead", "Security Engineer", "Office Manager",
)
MANAGER_ROLES = ("Director of Engineering", "VP Product", "Head of Operations", "CTO", "Director of Finance")

COMPANIES = (
    ("Orbit Labs", "orbitlabs.com"), ("Meridian Health", "meridianhealth.io"),
    ("Copperline Energy", "copperline.energy"), ("Tidewater Logistics", "tidewaterlog.com"),
    ("Harbor & Finch", "harborfinch.com"), ("Quillstone Media", "quillstone.media"),
    ("Brightfield Foods", "brightfieldfoods.com"), ("Northgate Robotics", "northgaterobotics.ai"),
)

# Project code names; each appears in one inbox only.
PROJECTS = (
    "Orion", "Atlas", "Juniper", "Nimbus", "Cobalt", "Sequoia", "Halcyon", "Vertex", "Lighthouse", "Meridian",
    "Kestrel", "Aurora", "Basalt", "Cascade", "Dynamo", "Ember", "Fathom", "Glacier", "Horizon", "Ironwood",
    "Jasper", "Keystone", "Lumen", "Monarch", "Nebula", "Obsidian", "Pioneer", "Quasar", "Redwood", "Summit",
    "Tundra", "Umbra", "Vanguard", "Willow", "Zephyr", "Beacon", "Citadel", "Drift", "Echo", "Foxglove",
)

VENDOR_PREFIXES = (
    "Northwind", "Bluepeak", "Silverline", "Granite", "Clearwater", "Redstone", "Oakridge", "Brightpath",
    "Ironbridge", "Sunmark", "Westfield", "Lakeshore", "Pinecrest", "Stonegate", "Highland", "Riverbend",
    "Evergreen", "Crescent", "Summitview", "Blackrock",
)
VENDOR_SUFFIXES = (
    "Traders", "Analytics", "Supplies", "Consulting", "Logistics", "Systems", "Partners", "Labs", "Print Co",
    "Catering", "Security", "Translations", "Cloud", "Research", "Staffing",
)

CITIES = (
    "Denver", "Lisbon", "Toronto", "Austin", "Seattle", "Chicago", "Boston", "Dublin", "Berlin", "Madrid",
    "Singapore", "Tokyo", "Nairobi", "Sydney", "Montreal", "Portland", "Atlanta", "Phoenix", "Oslo",
    "Prague", "Vienna", "Copenhagen", "Amsterdam", "Zurich", "Helsinki", "Seoul", "Mumbai", "Dubai",
    "Mexico City", "Bogota", "Lima", "Santiago", "Cape Town", "Auckland", "Vancouver", "Miami",
)
AIRLINES = ("UA", "DL", "AA", "BA", "LH", "AF", "KL", "AC", "TP", "SK")
HOME_AIRPORTS = ("SFO", "JFK", "ORD", "SEA", "BOS")
HOTELS = ("Grand Central Hotel", "Harborview Inn", "The Linden", "Parkside Suites", "Hotel Aurelia")

MEETING_TYPES = ("design review", "weekly sync", "kickoff", "retro", "planning meeting", "budget review", "demo")
ROOMS = ("Room 2A", "Room 3C", "Room 4B", "Room 5F", "Room 7D", "Cedar room", "Willow room", "Maple room",
         "Birch room", "Harbor room")
DELIVERABLES = ("design doc", "launch plan", "security review", "beta release", "customer report")
DOCUMENTS = ("architecture diagram", "pricing sheet", "roadmap deck", "contract draft", "test plan")
DECISION_TOPICS = ("data labeling", "cloud hosting", "security audit", "user research", "translation",
                   "event catering")
QUARTERS = ("Q1", "Q2", "Q3", "Q4")
CANDIDATE_ROLES = ("Senior Backend Engineer", "Product Designer", "Data Analyst", "Marketing Lead",
                   "Site Reliability Engineer", "Sales Engineer")

MEETING_TIMES = ("9:00 AM", "9:30 AM", "10:00 AM", "10:30 AM", "11:00 AM", "11:30 AM", "1:00 PM", "1:30 PM",
                 "2:00 PM", "2:30 PM", "3:00 PM", "3:30 PM", "4:00 PM", "4:30 PM")
FLIGHT_TIMES = ("6:05 AM", "7:15 AM", "8:40 AM", "10:20 AM", "12:55 PM", "2:35 PM", "5:10 PM", "7:45 PM")

GREETINGS = ("Hi {first},", "Hello {first},", "Hey {first},", "{first},", "Good morning {first},")
SIGN_OFFS = ("Thanks,", "Best,", "Cheers,", "Regards,", "Thanks!", "Talk soon,")

# Sentences that pad bodies with plausible, fact-free office prose.
FILLER = (
    "Let me know if anything looks off.",
    "I'll share notes afterwards.",
    "Happy to discuss if you have questions.",
    "Please loop in anyone I missed.",
    "This has been on my list for a while, so thanks for the patience.",
    "No action needed from you yet.",
    "I'll update the tracker once this is settled.",
    "Ping me on chat if it's urgent.",
    "Hope the week is going well.",
    "Sorry for the late notice.",
)

NEWSLETTER_SENDERS = (
    ("news@techbriefing.com", "Tech Briefing"), ("digest@industryweekly.com", "Industry Weekly"),
    ("updates@saasinsider.io", "SaaS Insider"), ("team@productletters.com", "Product Letters"),
)
NEWSLETTER_TOPICS = (
    "chip supply chains", "remote work tools", "AI regulation", "cloud pricing", "cybersecurity trends",
    "open-source funding", "logistics automation", "the creator economy", "battery storage", "fintech rules",
)
SOCIAL_SUBJECTS = (
    ("Lunch on Friday?", "Want to grab lunch on Friday? The new ramen place opened around the corner."),
    ("Team offsite photos", "I uploaded the offsite photos to the shared drive. Some great ones of the hike."),
    ("Coffee chat", "Would you be up for a quick coffee chat next week? I'd love to hear how things are going."),
    ("Book club pick", "This month's book club pick is a short one, so no excuses."),
    ("Parking garage closed", "Heads up: the parking garage is closed for maintenance this weekend."),
    ("Cake in the kitchen", "There is leftover birthday cake in the kitchen, help yourselves."),
    ("Running group", "A few of us run by the river on Wednesdays after work. Join us any time."),
)
IT_NOTICES = (
    ("Scheduled maintenance tonight", "The VPN will be unavailable for about an hour tonight for upgrades."),
    ("Password expiry reminder", "Your password expires soon. Please update it from the account portal."),
    ("New laptop policy", "All laptops must have disk encryption enabled. IT will check during the next audit."),
    ("Phishing warning", "We've seen phishing emails pretending to be from payroll. Do not click the links."),
    ("Benefits enrollment", "Open enrollment for benefits is now live. Review your options in the HR portal."),
)
STATUS_LINES = (
    "Progress is steady and we are roughly on track.",
    "We closed most of the open bugs this week.",
    "The team is heads down on integration work.",
    "Testing found a couple of edge cases we are fixing.",
    "We are waiting on feedback from the client before the next milestone.",
    "Hiring for the open role is still in progress.",
    "Velocity dipped a little because of the holidays.",
)
