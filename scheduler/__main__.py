from scheduler.service import main

main()
